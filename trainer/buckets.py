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
    dtype: torch.dtype  # on the wire


def wire_dtype(source: torch.dtype, serve_dtype: torch.dtype) -> torch.dtype:
    """Floating tensors are cast to the serving dtype; integer and bool
    buffers (routing tables, masks) keep their own."""
    return serve_dtype if source.is_floating_point else source


@dataclass
class Bucket:
    index: int
    nbytes: int
    slots: list[Slot]


def plan_buckets(params: list[ParamInfo], dtype: torch.dtype, bucket_bytes: int,
                 wire: dict[str, torch.dtype] | None = None) -> list[Bucket]:
    """Greedy in gather order. A tensor larger than a bucket gets a bucket of
    its own, so the bound is max(bucket_bytes, largest tensor). `dtype` is the
    serving dtype; `wire` overrides it per tensor (the server's index says
    which tensors travel wider or in their own dtype)."""
    buckets: list[Bucket] = []
    cur: list[Slot] = []
    used = 0
    for p in params:
        numel = 1
        for d in p.shape:
            numel *= d
        wire_dt = (wire or {}).get(p.name) or wire_dtype(p.dtype, dtype)
        size = numel * wire_dt.itemsize
        start = -(-used // ALIGN) * ALIGN
        if cur and start + size > bucket_bytes:
            buckets.append(Bucket(len(buckets), used, cur))
            cur, used, start = [], 0, 0
        cur.append(Slot(p.name, p.shape, start, size, wire_dt))
        used = start + size
    if cur:
        buckets.append(Bucket(len(buckets), used, cur))
    return buckets


def manifest(buckets: list[Bucket]) -> list[dict]:
    return [{"index": b.index, "nbytes": b.nbytes,
             "params": [{"name": s.name, "dtype": str(s.dtype).removeprefix("torch."),
                         "shape": list(s.shape), "offset": s.offset} for s in b.slots]}
            for b in buckets]
