"""What a push starts from: rank 0's reading of the servers, for every rank.

Rank 0 reads every replica's status and index (control/serving_state.py),
connects, and sees whether a delta or an adapter may go (`open_push`); the
pusher broadcasts the record, so every rank plans the same push
(push_plan.py): dense, delta (delta/), adapter (adapter/)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from rollout_sidecar.protocol.data_plane.bucket_check import preferred_check
from rollout_sidecar.protocol.data_plane.wire_format import dtype_name
from rollout_sidecar.protocol.schema import CHECK_SUM64, AdapterSpec, Check, WeightIndex
from rollout_sidecar.protocol.transports import transport as transport_kind
from rollout_sidecar.trainer.adapter.adapter_push import AdapterPush
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.delta.delta_push import replicas_base
from rollout_sidecar.trainer.draft_push import draft_buffers
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import persistent_buffers
from rollout_sidecar.trainer.gather.named_tensors import NamedTensors
from rollout_sidecar.trainer.gather.peft_merge import PeftMerge
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.rank_agreement import world
from rollout_sidecar.trainer.sending_ranks import choose_senders
from rollout_sidecar.trainer.transport.base import Transport
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from rollout_sidecar.trainer.transport.peer_sender import Rendezvous

NAMED_DENSE = "a push from named tensors: no shard copy to diff against, dense"


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
    # A push from named tensors (gather/named_tensors.py): the served index,
    # which every rank checks its stream against.
    index: WeightIndex | None = None


def open_push(source: nn.Module | NamedTensors, version: int, adapter: bool | None,
              draft: nn.Module | None, replicas: ReplicaAdmins, transport: Transport,
              serving: ServingState, config: PushConfig, adapters: AdapterPush,
              copy_version: int | None) -> Opening:
    """Rank 0: check the replicas, connect, and see whether an adapter or a
    delta may go. `copy_version`: the version the trainer's shard copy holds
    (a delta's base), if it keeps one."""
    named = isinstance(source, NamedTensors)
    merge = PeftMerge(source if not named else nn.Module())  # a PEFT model goes merged
    restarted = serving.read(replicas, version, config.on_server_restart,
                             config.on_absent_replica)
    assert serving.index is not None
    draft_bufs = None  # checked before anything connects
    if draft is not None:
        draft_bufs = draft_buffers(draft, replicas.urls, serving.statuses, serving.index.tensors)
        adapter = False  # the drafter goes with full weights (draft_push.py)
    # Persistent buffers the served checkpoint holds travel with the params
    # (named tensors carry their own).
    buffers = [] if named else sorted(n for n in persistent_buffers(source)
                                      if merge.rename(n) in serving.index.tensors)
    on_device = transport_kind(transport.name).on_device
    check = preferred_check(on_device, all(CHECK_SUM64 in s.capabilities
                                           for s in serving.statuses))
    senders, senders_reason = choose_senders(config.senders, transport.name, world(),
                                             serving.statuses)
    rendezvous = None
    if senders > 1 and isinstance(transport, DistributedTransport):
        rendezvous = transport.plan_connect(serving.statuses, senders)  # every rank joins it
    else:
        transport.ensure_connected(serving.statuses)
    spec, adapter_reason = (None, None) if named else adapters.choose(
        source, serving.statuses, replicas.urls, adapter)
    converted = not named and (merge.active or CheckpointLayout(merge.base_model).active)
    base: int | None
    why: str | None
    if named:
        base, why = None, NAMED_DENSE
    elif converted:  # what travels is computed from several tensors: no shard to diff
        base, why = None, "a PEFT model (pushed merged) or a checkpoint conversion: dense"
    else:
        base, why = replicas_base(serving.statuses, replicas.urls, copy_version)
    return Opening(restarted, dtype_name(serving.serve_dtype),
                   {n: t.dtype for n, t in serving.index.tensors.items()}, buffers,
                   base, why, keep_copy=not (converted or named), adapter=spec,
                   adapter_reason=adapter_reason, check=check, senders=senders,
                   senders_reason=senders_reason, rendezvous=rendezvous,
                   draft_buffers=draft_bufs, index=serving.index if named else None)
