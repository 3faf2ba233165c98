"""Pack parameters into fixed-size byte buckets.

The layout (which tensor at which offset of which bucket) is computed once from
shapes alone, sent once per push as the manifest, and the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_sidecar.trainer.gather import ParamInfo

ALIGN = 64  # bytes; keeps every tensor view aligned for any dtype


@dataclass
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    index: int
    nbytes: int
    slots: list[Slot]


def plan_buckets(params: list[ParamInfo], dtype: torch.dtype, bucket_bytes: int) -> list[Bucket]:
    """Greedy in gather order. A tensor larger than a bucket gets a bucket of
    its own, so the bound is max(bucket_bytes, largest tensor)."""
    buckets: list[Bucket] = []
    cur: list[Slot] = []
    used = 0
    for p in params:
        numel = 1
        for d in p.shape:
            numel *= d
        size = numel * dtype.itemsize
        start = -(-used // ALIGN) * ALIGN
        if cur and start + size > bucket_bytes:
            buckets.append(Bucket(len(buckets), used, cur))
            cur, used, start = [], 0, 0
        cur.append(Slot(p.name, p.shape, start, size))
        used = start + size
    if cur:
        buckets.append(Bucket(len(buckets), used, cur))
    return buckets


def manifest(buckets: list[Bucket], dtype: torch.dtype) -> list[dict]:
    dtype_name = str(dtype).removeprefix("torch.")
    return [{"index": b.index, "nbytes": b.nbytes,
             "params": [{"name": s.name, "dtype": dtype_name, "shape": list(s.shape),
                         "offset": s.offset} for s in b.slots]} for b in buckets]
