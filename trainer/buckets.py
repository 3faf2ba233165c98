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

from dataclasses import dataclass

import torch

from rollout_sidecar.trainer.gather import ParamInfo

ALIGN = 64  # bytes; keeps every tensor view aligned for any dtype


@dataclass
class Slot:
    """One tensor, or one chunk of it, at `offset` in a bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int  # bytes in this bucket: the whole tensor, or this chunk
    dtype: torch.dtype  # on the wire
    chunk_offset: int | None = None  # where the chunk starts in the tensor's bytes

    @property
    def tensor_nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    @property
    def first(self) -> bool:
        """The slot where the tensor's bytes begin: rank 0 draws it here."""
        return not self.chunk_offset

    @property
    def last(self) -> bool:
        """The slot where the tensor's bytes end: rank 0 drops it after this."""
        return self.chunk_offset is None or self.chunk_offset + self.nbytes == self.tensor_nbytes


def wire_dtype(source: torch.dtype, serve_dtype: torch.dtype) -> torch.dtype:
    """Floating tensors are cast to the serving dtype; integer and bool
    buffers (routing tables, masks) keep their own."""
    return serve_dtype if source.is_floating_point else source


@dataclass
class Bucket:
    index: int
    nbytes: int
    slots: list[Slot]


class _Planner:
    """Greedy, in gather order: fills one bucket at a time."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets: list[Bucket] = []
        self.cur: list[Slot] = []
        self.used = 0

    def start(self) -> int:
        return -(-self.used // ALIGN) * ALIGN

    def close(self) -> None:
        if self.cur:
            self.buckets.append(Bucket(len(self.buckets), self.used, self.cur))
        self.cur, self.used = [], 0

    def add(self, slot: Slot) -> None:
        self.cur.append(slot)
        self.used = slot.offset + slot.nbytes

    def place_whole(self, name: str, shape: tuple[int, ...], dt: torch.dtype,
                    size: int) -> None:
        if self.cur and self.start() + size > self.bucket_bytes:
            self.close()
        self.add(Slot(name, shape, self.start(), size, dt))

    def place_split(self, name: str, shape: tuple[int, ...], dt: torch.dtype,
                    size: int) -> None:
        done = 0
        while done < size:
            # Whole elements per chunk: the sender casts chunk by chunk.
            room = (self.bucket_bytes - self.start()) // dt.itemsize * dt.itemsize
            if room < min(ALIGN, size - done):  # no slivers at a bucket's end
                self.close()
                continue
            n = min(room, size - done)
            self.add(Slot(name, shape, self.start(), n, dt, chunk_offset=done))
            done += n


def plan_buckets(params: list[ParamInfo], dtype: torch.dtype, bucket_bytes: int,
                 wire: dict[str, torch.dtype] | None = None,
                 split: bool = True) -> list[Bucket]:
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
        numel = 1
        for d in p.shape:
            numel *= d
        wire_dt = (wire or {}).get(p.name) or wire_dtype(p.dtype, dtype)
        size = numel * wire_dt.itemsize
        if split and size > bucket_bytes:
            plan.place_split(p.name, p.shape, wire_dt, size)
        else:
            plan.place_whole(p.name, p.shape, wire_dt, size)
    plan.close()
    return plan.buckets


def _entry(s: Slot) -> dict:
    entry = {"name": s.name, "dtype": str(s.dtype).removeprefix("torch."),
             "shape": list(s.shape), "offset": s.offset}
    if s.chunk_offset is not None:  # unsplit tensors look as they always did
        entry.update(chunk_offset=s.chunk_offset, nbytes=s.nbytes)
    return entry


def manifest(buckets: list[Bucket]) -> list[dict]:
    """The wire form. A chunk of a split tensor carries `chunk_offset` (where
    it starts in the tensor's wire-dtype bytes) and `nbytes` (its length), with
    the full tensor's `shape`."""
    return [{"index": b.index, "nbytes": b.nbytes, "params": [_entry(s) for s in b.slots]}
            for b in buckets]
