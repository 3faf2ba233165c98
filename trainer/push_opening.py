"""What a push starts from: rank 0's reading of the servers, for every rank.

Rank 0 reads every replica's status and index (control/serving_state.py) and
the pusher broadcasts this record, so every rank plans the same push
(push_plan.py): dense, delta (delta/), adapter (adapter/)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sidecar.protocol.schema import AdapterSpec, Check
from rollout_sidecar.trainer.transport.peer_sender import Rendezvous


@dataclass
class Opening:
    """Rank 0's reading of the servers at a push's start, for every rank."""

    restarted: bool
    serve_dtype: str
    wire_dtypes: dict[str, str]  # the served index's dtype per tensor
    buffers: list[str]  # persistent buffers that travel with the parameters
    delta_base: int | None  # the base every replica holds, if a delta may go
    why_dense: str | None  # else why not
    keep_copy: bool = True  # False: this model never goes as a delta (PEFT, conversions)
    adapter: AdapterSpec | None = None  # a LoRA adapter push (trainer/adapter/)
    adapter_reason: str | None = None  # why a PEFT model goes merged
    check: Check = "crc32"  # each bucket's check (bucket_check.py), as every replica takes
    senders: int = 1  # trainer ranks in the data-plane group (sending_ranks.py)
    senders_reason: str | None = None  # why one, where every rank was asked to
    rendezvous: Rendezvous | None = None  # a connection for every sender to join, if new
    # A push with a drafter (draft_push.py): its persistent buffers that travel
    # (the drafter's own names); None: the push leaves the drafter frozen.
    draft_buffers: list[str] | None = None
