"""Buckets of a push where each trainer rank sends its own rows
(gather/own_rows.py): every rank's pieces packed into buckets of its own, and
the manifest taking one bucket of each rank in turn.

Each rank's buckets hold only bytes it has, so it sends without a gather; a
piece that does not fit the room left is split there (a chunk of a chunk),
like any tensor larger than a bucket (buckets.py). Taking the ranks' buckets
in turn puts one of each rank in every run of N consecutive buckets, which
the receiver takes side by side (bucket_group.relay_buckets posts a window
of `senders` buckets), so N links carry the push at once.
"""

from __future__ import annotations

import math

import torch

from rollout_sidecar.protocol.schema import BucketManifest
from rollout_sidecar.trainer.gather.own_rows import Piece
from rollout_sidecar.trainer.pack.buckets import ALIGN, _Planner, wire_dtype


def _rank_buckets(pieces: list[Piece], dtype: torch.dtype, bucket_bytes: int,
                  wire: dict[str, torch.dtype]) -> list[BucketManifest]:
    plan = _Planner(bucket_bytes)
    for p in pieces:
        dt = wire.get(p.name) or wire_dtype(p.dtype, dtype)
        size = math.prod(p.shape) * dt.itemsize
        if p.covers_tensor and size <= bucket_bytes:
            plan.place_whole(p.name, p.shape, dt, size)
            continue
        row = math.prod(p.shape[1:]) * dt.itemsize
        plan.place_split(p.name, p.shape, dt, p.end * row, p.first * row)
    plan.close()
    return plan.buckets


def plan_rank_buckets(pieces: list[list[Piece]], dtype: torch.dtype, bucket_bytes: int,
                      wire: dict[str, torch.dtype] | None = None) -> list[BucketManifest]:
    """The manifest: rank r's buckets hold its pieces (`sender` r), one of
    each rank in turn, indexed in that order. `dtype` is the serving dtype;
    `wire` overrides it per tensor, as in `plan_buckets`."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket of {bucket_bytes} bytes: splitting needs at least {ALIGN}")
    per_rank = [_rank_buckets(p, dtype, bucket_bytes, wire or {}) for p in pieces]
    out: list[BucketManifest] = []
    for k in range(max((len(b) for b in per_rank), default=0)):
        for r, buckets in enumerate(per_rank):
            if k < len(buckets):
                out.append(buckets[k].model_copy(update={"index": len(out), "sender": r}))
    return out
