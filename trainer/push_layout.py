"""A push's buckets, and which trainer ranks send them: laid out once, by
rank 0, at begin (pusher.py sends the result in `POST /weights/begin`).

- a delta: the buckets its plan holds (rank 0 encodes; one sender);
- dense, one sender: every tensor in gather order (pack/buckets.py), after
  a PEFT merge or a checkpoint conversion where the model needs one;
- dense, every rank sending its own FSDP2 rows: each rank's buckets of its
  rows, one of each rank in turn (gather/own_rows.py, pack/rank_buckets.py);
- dense, every rank sending gathered tensors: the one-sender layout with
  each bucket given to a rank by bytes (pack/bucket_senders.py).

Each choice that falls back says why: `Layout.senders_reason`,
`own_rows_reason` (read into `PushResult`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from rollout_sidecar.protocol.schema import CHUNKS_INTERLEAVED, BucketManifest
from rollout_sidecar.trainer.adapter.lora_adapter import LoraAdapter
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.draft_push import draft_plan
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import param_plan
from rollout_sidecar.trainer.gather.named_tensors import NamedLayout, NamedTensors
from rollout_sidecar.trainer.gather.own_rows import rank_pieces, why_not
from rollout_sidecar.trainer.gather.peft_merge import PeftMerge
from rollout_sidecar.trainer.pack.bucket_senders import assign_senders, share_bytes
from rollout_sidecar.trainer.pack.buckets import plan_buckets
from rollout_sidecar.trainer.pack.rank_buckets import plan_rank_buckets
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.push_opening import Opening
from rollout_sidecar.trainer.push_plan import PushPlan
from rollout_sidecar.trainer.rank_agreement import all_ranks, world


@dataclass(frozen=True)
class Layout:
    buckets: list[BucketManifest]
    senders: int = 1  # trainer ranks that send the buckets
    senders_reason: str | None = None  # why one, where the connection has several
    own_rows: bool = False  # each rank sends its own FSDP2 rows (gather/own_rows.py)
    own_rows_reason: str | None = None  # why not, where several ranks send


def why_gathered(model: nn.Module, opening: Opening, config: PushConfig) -> str | None:
    """Every rank (a collective where several ranks send): why the ranks
    cannot send their own rows, any rank's reason (each checks its own
    shards); None: they can."""
    if opening.senders == 1:
        return "one sender"
    reasons = all_ranks(why_not(model, world()) if config.own_rows else "own_rows=False")
    return next((f"trainer rank {r}: {w}" for r, w in enumerate(reasons) if w), None)


def senders_of(plan: PushPlan) -> tuple[int, str | None]:
    """This push's senders: the connection's, for a dense push of the
    model's own tensors; rank 0 encodes a delta or an adapter, and converts
    a PEFT model or a checkpoint layout."""
    o = plan.opening
    if o.senders == 1:
        return 1, o.senders_reason
    if plan.delta is not None:
        return 1, "a delta push: rank 0 encodes every rank's changes"
    if plan.adapter is not None:
        return 1, "an adapter push: rank 0 converts the factors"
    if not o.keep_copy and o.index is None:  # (named tensors keep no copy either)
        return 1, "a PEFT model or a checkpoint conversion: rank 0 converts"
    return o.senders, None


def lay_out(model: nn.Module | NamedTensors, plan: PushPlan, draft: nn.Module | None,
            serving: ServingState, config: PushConfig, named: NamedLayout) -> Layout:
    """Rank 0: the push's buckets and senders (module docstring)."""
    buffers = plan.opening.buffers if plan.sends_buffers else ()
    senders, why = senders_of(plan)
    if isinstance(model, NamedTensors) and not model.every_rank and senders > 1:
        senders, why = 1, "named tensors given on rank 0 alone"
    if plan.delta is not None:
        return Layout(plan.delta.buckets, senders, why)
    rows_why = None
    if senders > 1 and isinstance(model, nn.Module):
        rows_why = plan.why_gathered or serving.lacks(CHUNKS_INTERLEAVED)
        if rows_why is None:
            pieces = rank_pieces(model, senders, buffers)
            buckets = plan_rank_buckets(pieces, serving.serve_dtype, config.bucket_bytes,
                                        serving.wire_dtypes)
            size = share_bytes(sum(b.nbytes for b in buckets), senders, config.bucket_bytes)
            if size < config.bucket_bytes:  # several buckets a rank (bucket_senders.py)
                buckets = plan_rank_buckets(pieces, serving.serve_dtype, size,
                                            serving.wire_dtypes)
            return Layout(buckets, senders, why, True)
    if isinstance(model, NamedTensors):
        assert serving.index is not None
        params = named.plan(serving.index)
    elif plan.adapter is not None:
        params = LoraAdapter(model).plan(param_plan(model, buffers), plan.adapter.with_base)
    else:
        merge = PeftMerge(model)
        params = CheckpointLayout(merge.base_model).plan(merge.plan(param_plan(model, buffers)))
    if draft is not None and plan.opening.draft_buffers is not None:
        params += draft_plan(draft, plan.opening.draft_buffers)
    buckets = plan_buckets(params, serving.serve_dtype, config.bucket_bytes,
                           serving.wire_dtypes, config.split_tensors)
    if senders > 1:
        size = share_bytes(sum(b.nbytes for b in buckets), senders, config.bucket_bytes)
        if size < config.bucket_bytes:  # small enough to share out (bucket_senders.py)
            buckets = plan_buckets(params, serving.serve_dtype, size, serving.wire_dtypes,
                                   config.split_tensors)
        buckets = assign_senders(buckets, senders)
    return Layout(buckets, senders, why, False, rows_why)
