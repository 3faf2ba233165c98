"""A delta push's manifest, from counts alone: each tensor's form, the buckets.

Every rank diffs its own pieces first (shard_copy.py) and shares four numbers
per tensor: how many elements changed, the first and last changed position,
and the largest distance between two changes inside its piece. From those,
every rank computes the same plan:

- a tensor with more than `dense_above` of its elements changed travels whole
  (the dense form); one with no change still has a slot (zero bytes), so the
  server's coverage check stays what it is for a dense push;
- otherwise the smallest of int32 indices, uint16 gaps (while no two changes,
  nor the first from 0, are 65536 or more apart) and a bitmap, plus values;
- slots are packed greedily into buckets of at most `bucket_bytes`; a patch
  larger than a bucket gets one of its own.

`worth_it` says whether the push should be a delta at all: not when the
patches would carry more than `MAX_SHARE` of the dense bytes (a push after
many steps, or a model that just started training), nor when a tensor that
travels whole is larger than a bucket (rank 0 would hold it whole; the dense
path streams it in row blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollout_sidecar.protocol.data_plane.delta_codec import PatchForm
from rollout_sidecar.protocol.data_plane.wire_format import dtype_name
from rollout_sidecar.protocol.schema import BucketManifest, TensorSlot
from rollout_sidecar.protocol.schema.manifest_api import PatchInfo, patch_nbytes
from rollout_sidecar.trainer.pack.buckets import ALIGN

GAP_LIMIT = 1 << 16
# Above this share of the dense bytes a delta saves too little wire for its
# diff and scatter, and rank 0 would hold that much of the model at once.
MAX_SHARE = 0.5


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # on the wire
    form: PatchForm
    changed: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return patch_nbytes(self.form.value, self.numel, self.changed, self.dtype.itemsize)

    @property
    def dense_nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def choose_forms(names: list[str], shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                 stats: torch.Tensor, dense_above: float) -> list[TensorPlan]:
    """`stats`: [ranks, tensors, 4] int64 of (count, first, last, max_gap),
    first/last -1 on a rank with no change in that tensor."""
    out = []
    for t, (name, shape, dt) in enumerate(zip(names, shapes, dtypes, strict=True)):
        per_rank = stats[:, t].tolist()
        count = sum(r[0] for r in per_rank)
        numel = math.prod(shape)
        if count > dense_above * numel:
            out.append(TensorPlan(name, shape, dt, PatchForm.DENSE, numel))
            continue
        sizes = {f: patch_nbytes(f.value, numel, count, dt.itemsize)
                 for f in (PatchForm.INDEX, PatchForm.BITMAP)}
        if _max_gap(per_rank) < GAP_LIMIT:
            sizes[PatchForm.GAPS] = patch_nbytes("gaps", numel, count, dt.itemsize)
        out.append(TensorPlan(name, shape, dt, min(sizes, key=lambda f: sizes[f]), count))
    return out


def _max_gap(per_rank: list[list[int]]) -> int:
    """The largest gap the gaps form would store: inside each rank's piece,
    between one rank's last change and the next one's first, and the first
    change's distance from 0. Ranks hold disjoint ranges, in rank order with
    FSDP2, not with HSDP (replica groups split each shard): taken by first
    change."""
    gap, prev = 0, 0
    for _, first, last, inner in sorted((r for r in per_rank if r[0]), key=lambda r: r[1]):
        gap = max(gap, inner, first - prev)
        prev = last
    return gap


def worth_it(plans: list[TensorPlan], dense_above: float, bucket_bytes: int) -> str | None:
    """None if a delta push is worth sending, else why not (PushResult says it)."""
    delta = sum(p.nbytes for p in plans)
    dense = sum(p.dense_nbytes for p in plans)
    if delta > MAX_SHARE * dense:
        return f"the delta would carry {delta / dense:.0%} of the dense bytes"
    big = [p.name for p in plans if p.form is PatchForm.DENSE and p.nbytes > bucket_bytes]
    if big:
        return f"{big[0]} changed in more than {dense_above:.0%} of its elements and is " \
               "larger than a bucket"
    return None


def plan_patch_buckets(plans: list[TensorPlan], bucket_bytes: int) -> list[BucketManifest]:
    """Greedy, in plan order; a slot that does not fit the room left starts
    the next bucket, and one larger than a bucket gets a bucket of its own."""
    buckets: list[BucketManifest] = []
    cur: list[TensorSlot] = []
    used = 0

    def close() -> None:
        nonlocal cur, used
        if cur:  # never an empty bucket, and at least ALIGN bytes
            buckets.append(BucketManifest(index=len(buckets), nbytes=max(used, ALIGN),
                                          params=cur))
        cur, used = [], 0

    for p in plans:
        start = -(-used // ALIGN) * ALIGN
        if cur and start + p.nbytes > bucket_bytes:
            close()
            start = 0
        cur.append(TensorSlot.model_construct(
            name=p.name, dtype=dtype_name(p.dtype), shape=list(p.shape), offset=start,
            chunk_offset=None, nbytes=None,
            patch=PatchInfo.model_construct(form=p.form.value, changed=p.changed)))
        used = start + p.nbytes
    close()
    return buckets
