"""Pack parameters into fixed-size byte buckets.

The layout (which tensor, or which byte range of it, at which offset of which
bucket) is computed once from shapes alone, sent once per push as the
manifest, and the same on every rank.

A tensor larger than a bucket is split into chunks across consecutive buckets,
so every bucket holds at most `bucket_bytes` and rank 0's two send buffers
stay 2 x bucket however large the embedding is. A tensor that fits in a
bucket is never split: when it does not fit in the space left, it starts the
next bucket (as before chunks existed), and the server loads it zero-copy.
"""

from __future__ import annotations

import math

import torch

from rollout_sidecar.protocol.data_plane.wire_format import dtype_name
from rollout_sidecar.protocol.schema import BucketManifest, TensorSlot
from rollout_sidecar.protocol.schema.manifest_api import SLOT_ALIGN
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo

ALIGN = SLOT_ALIGN  # bytes; keeps every tensor view aligned for any dtype


def wire_dtype(source: torch.dtype, serve_dtype: torch.dtype) -> torch.dtype:
    """Floating tensors are cast to the serving dtype; integer and bool
    buffers (routing tables, masks) keep their own."""
    return serve_dtype if source.is_floating_point else source


class _Planner:
    """Greedy, in gather order: fills one bucket at a time."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets: list[BucketManifest] = []
        self.cur: list[TensorSlot] = []
        self.used = 0

    def start(self) -> int:
        return -(-self.used // ALIGN) * ALIGN

    def close(self) -> None:
        if self.cur:
            self.buckets.append(BucketManifest(index=len(self.buckets), nbytes=self.used,
                                               params=self.cur))
        self.cur, self.used = [], 0

    def add(self, slot: TensorSlot) -> None:
        self.cur.append(slot)
        self.used = slot.offset + slot.length

    def place_whole(self, name: str, shape: tuple[int, ...], dt: torch.dtype,
                    size: int) -> None:
        if self.cur and self.start() + size > self.bucket_bytes:
            self.close()
        self.add(TensorSlot.model_construct(name=name, dtype=dtype_name(dt), shape=list(shape),
                                           offset=self.start(), chunk_offset=None,
                                           nbytes=None))

    def place_split(self, name: str, shape: tuple[int, ...], dt: torch.dtype,
                    size: int, done: int = 0) -> None:
        """Bytes [done, size) of the tensor, as chunks (from `done`: a rank's
        own rows, pack/rank_buckets.py)."""
        while done < size:
            # Whole elements per chunk: the sender casts chunk by chunk.
            room = (self.bucket_bytes - self.start()) // dt.itemsize * dt.itemsize
            if room < min(ALIGN, size - done):  # no slivers at a bucket's end
                self.close()
                continue
            n = min(room, size - done)
            self.add(TensorSlot.model_construct(name=name, dtype=dtype_name(dt),
                                               shape=list(shape), offset=self.start(),
                                               chunk_offset=done, nbytes=n))
            done += n


def plan_buckets(params: list[ParamInfo], dtype: torch.dtype, bucket_bytes: int,
                 wire: dict[str, torch.dtype] | None = None,
                 split: bool = True) -> list[BucketManifest]:
    """Greedy in gather order; every bucket holds at most `bucket_bytes`.
    `dtype` is the serving dtype; `wire` overrides it per tensor (the server's
    index says which tensors travel wider or in their own dtype). With
    `split=False` a tensor larger than a bucket gets a bucket of its own
    instead (servers that predate chunks; the bound is then
    max(bucket_bytes, largest tensor))."""
    if split and bucket_bytes < ALIGN:
        raise ValueError(f"bucket of {bucket_bytes} bytes: splitting needs at least {ALIGN}")
    plan = _Planner(bucket_bytes)
    for p in params:
        wire_dt = (wire or {}).get(p.name) or wire_dtype(p.dtype, dtype)
        size = math.prod(p.shape) * wire_dt.itemsize
        if split and size > bucket_bytes:
            plan.place_split(p.name, p.shape, wire_dt, size)
        else:
            plan.place_whole(p.name, p.shape, wire_dt, size)
    plan.close()
    return plan.buckets


def manifest(buckets: list[BucketManifest]) -> list[dict]:
    """The wire form. A chunk of a split tensor carries `chunk_offset` (where
    it starts in the tensor's wire-dtype bytes) and `nbytes` (its length), with
    the full tensor's `shape`; an unsplit entry carries neither."""
    return [b.model_dump(exclude_none=True) for b in buckets]
