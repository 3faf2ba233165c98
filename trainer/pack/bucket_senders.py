"""Which trainer rank sends each bucket of a push with several senders.

Shared out by bytes: each bucket, in order, goes to the rank that has the
fewest bytes so far, so N ranks' links each carry about 1/N of the push (the
busiest at most one bucket over), and consecutive buckets go to different
ranks, which the receiver takes side by side (bucket_group.relay_buckets).
Every rank holds every gathered tensor whole then (`full_tensor()`: row
blocks, which reach rank 0 alone, are off while every rank sends).

A bucket is the unit shared out, so the buckets must be small enough to
share: a model smaller than one bucket (the default 256 MiB) was one bucket,
all of it sent by rank 0 while the result said two senders (issue 58: 252 MB
out of rank 0's link, 50 MB, its gather share alone, out of rank 1's).
`share_bytes` caps a bucket at 1/`PER_SENDER` of a sender's share, so each
link carries at most (1 + 1/PER_SENDER) x its share; the buckets stay whole
pieces of the gather order, split where a tensor is larger (pack/buckets.py).

A push of own rows (pack/rank_buckets.py) is cut the same way, though each
rank sends exactly its rows whatever the size: a chain over several replicas
relays each replica's buckets in manifest order, so with one bucket a rank
the ring's relays ran one after the other (two replicas took 5.2 s where
the wire needed 2.1 s: bench/push_scaling.py); with several, the buckets
entering at each replica alternate and the relays run side by side.
"""

from __future__ import annotations

import math

from rollout_sidecar.protocol.schema import BucketManifest

PER_SENDER = 8  # buckets per sender, at least, where the model allows
MIN_BUCKET = 1 << 20  # below this a bucket's fixed costs (a send, a check) dominate


def share_bytes(total: int, senders: int, bucket_bytes: int) -> int:
    """The bucket size that shares `total` wire bytes out over `senders`
    (module docstring): `bucket_bytes` where the model is large enough."""
    return max(min(bucket_bytes, MIN_BUCKET), min(bucket_bytes, math.ceil(
        total / (senders * PER_SENDER))))


def assign_senders(buckets: list[BucketManifest], senders: int) -> list[BucketManifest]:
    """`buckets` with each one's `sender` set (module docstring)."""
    load = [0] * senders
    out = []
    for b in buckets:
        rank = min(range(senders), key=lambda r: (load[r], r))
        load[rank] += b.nbytes
        out.append(b.model_copy(update={"sender": rank}))
    return out
