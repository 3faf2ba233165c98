"""Which trainer rank sends each bucket of a push with several senders.

Shared out by bytes: each bucket, in order, goes to the rank that has the
fewest bytes so far, so N ranks' links each carry about 1/N of the push (the
busiest at most one bucket over), and consecutive buckets go to different
ranks, which the receiver takes side by side (bucket_group.relay_buckets).
Every rank holds every gathered tensor whole then (`full_tensor()`: row
blocks, which reach rank 0 alone, are off while every rank sends).
"""

from __future__ import annotations

from rollout_sidecar.protocol.schema import BucketManifest


def assign_senders(buckets: list[BucketManifest], senders: int) -> list[BucketManifest]:
    """`buckets` with each one's `sender` set (module docstring)."""
    load = [0] * senders
    out = []
    for b in buckets:
        rank = min(range(senders), key=lambda r: (load[r], r))
        load[rank] += b.nbytes
        out.append(b.model_copy(update={"sender": rank}))
    return out
