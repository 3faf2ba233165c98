"""The pusher's delta step: decide, diff, plan, and after a commit, remember.

`WeightPusher(delta="auto")` (the default) sends a push as a delta when all
of these hold, and dense otherwise (`PushResult.encoding` and
`PushResult.delta_reason` say which, and why):

- every replica's staged copy is at the version this trainer's shard copies
  hold (`WeightStatus.delta_base`): not after a restart, a missed, failed or
  partial push, a new replica or another trainer's push;
- the model's layout is covered (shard_pieces.py) and its tensors travel as
  they are (no PEFT merge, no checkpoint conversion: those stay dense);
- the patches would carry at most half the dense bytes (patch_plan.py); a
  sample of every piece decides first, so a dense step skips the full diff
  (early_sample.py).

Every rank takes the same path: rank 0's view of the servers (`Opening`) is
broadcast, each rank checks its own copy, and the counts that decide the plan
are all-gathered. The copies move to a version only after every replica
committed it (`committed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.schema import BucketManifest, WeightStatus
from rollout_sidecar.trainer.delta.early_sample import EARLY_DENSE, estimated_share
from rollout_sidecar.trainer.delta.patch_gather import DeltaDiff
from rollout_sidecar.trainer.delta.patch_plan import (
    TensorPlan,
    choose_forms,
    plan_patch_buckets,
    worth_it,
)
from rollout_sidecar.trainer.delta.shard_copy import ShardCopy
from rollout_sidecar.trainer.delta.shard_pieces import Piece, shard_pieces
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo, param_plan
from rollout_sidecar.trainer.pack.buckets import wire_dtype
from rollout_sidecar.trainer.rank_agreement import any_rank, rank

if TYPE_CHECKING:  # push_opening reads replicas_base: no import cycle
    from rollout_sidecar.trainer.push_opening import Opening


def replicas_base(statuses: list[WeightStatus], urls: list[str], copy_version: int | None
                  ) -> tuple[int | None, str | None]:
    """The base a delta may name, or why none: every replica must hold the
    version this trainer's copies hold."""
    if copy_version is None:
        return None, "no copy of a committed version yet (the first push is dense)"
    for url, st in zip(urls, statuses, strict=True):
        if st.delta_base != copy_version:
            held = "nothing it can patch" if st.delta_base is None else \
                f"version {st.delta_base}"
            return None, f"{url} holds {held}, not the base {copy_version}"
    return copy_version, None


@dataclass
class DeltaPlan:
    diff: DeltaDiff
    plans: list[TensorPlan]
    buckets: list[BucketManifest]
    base: int


class DeltaPush:
    def __init__(self, copy_location: str, dense_above: float) -> None:
        self.copy = ShardCopy(copy_location)
        self.dense_above = dense_above

    def _layout(self, model: nn.Module, opening: Opening
                ) -> tuple[list[ParamInfo], list[Piece] | None, list[torch.dtype]]:
        """Every tensor in push order with its wire dtype (the same on every
        rank), this rank's pieces, and their wire dtypes."""
        serve = torch_dtype(opening.serve_dtype)
        params = [ParamInfo(p.name, p.shape, _wire(opening, p.name, p.dtype, serve))
                  for p in param_plan(model, opening.buffers)]
        wire = {p.name: p.dtype for p in params}
        pieces = shard_pieces(model, rank(), opening.buffers)
        dtypes = [wire[p.name] for p in pieces] if pieces is not None else []
        return params, pieces, dtypes

    def plan(self, model: nn.Module, opening: Opening, bucket_bytes: int
             ) -> tuple[DeltaPlan | None, str | None]:
        """On every rank: the delta plan, or None and why the push is dense."""
        if opening.delta_base is None:
            return None, opening.why_dense
        params, pieces, dtypes = self._layout(model, opening)
        mine = pieces is not None and self.copy.holds(pieces, dtypes) \
            and self.copy.version == opening.delta_base
        if any_rank(not mine):
            return None, "a rank's shard copy does not match this layout or base"
        assert pieces is not None
        names = [p.name for p in params]
        diff = DeltaDiff(pieces, self.copy, names, self.dense_above)
        why = self._dense_step(diff, params)  # a collective: every rank is here
        if why is not None:
            return None, why
        stats = diff.stats()  # a collective: every rank is here
        plans = choose_forms(names, [p.shape for p in params], [p.dtype for p in params],
                             stats, self.dense_above)
        why = worth_it(plans, self.dense_above, bucket_bytes)
        if why is not None:
            return None, why
        # Nothing changed: no bucket at all; the servers relabel what they hold.
        buckets = plan_patch_buckets(plans, bucket_bytes) if any(p.changed for p in plans) \
            else []
        return DeltaPlan(diff, plans, buckets, opening.delta_base), None

    def _dense_step(self, diff: DeltaDiff, params: list[ParamInfo]) -> str | None:
        """Why the push goes dense with no full diff, where a sample of every
        rank's pieces says its patches would carry most of the dense bytes
        (early_sample.py); None: diff it all."""
        sampled = diff.sampled()
        share = estimated_share(sampled, [p.shape for p in params], [p.dtype for p in params],
                                self.dense_above)
        if share <= EARLY_DENSE:
            return None
        seen, changed = (int(x) for x in sampled.sum(dim=(0, 1)).tolist())
        return (f"a dense step: {changed / seen:.0%} of {seen} sampled elements changed, so "
                f"its patches would carry about {share:.0%} of the dense bytes (decided on "
                "the sample, with no full diff)")

    def committed(self, model: nn.Module, opening: Opening, version: int,
                  delta: DeltaPlan | None = None) -> None:
        """Every replica committed `version`: every rank's copy becomes it
        (after a delta, by writing in the changes it carried)."""
        if delta is not None and self.copy.version == delta.base:
            self.copy.advance(delta.diff.pieces, delta.diff.changes, version)
            return
        _, pieces, dtypes = self._layout(model, opening)
        if pieces is None:
            self.copy.forget()
        else:
            self.copy.refresh(pieces, dtypes, version)


def _wire(opening: Opening, name: str, dtype: torch.dtype, serve: torch.dtype) -> torch.dtype:
    known = opening.wire_dtypes.get(name)
    return torch_dtype(known) if known is not None else wire_dtype(dtype, serve)
