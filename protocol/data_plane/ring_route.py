"""Where each bucket enters the chain of receivers, and where it goes from
each one: one chain, or a ring entered at a different replica per bucket.

A chain (`bucket_group.relay_buckets`) relays every bucket from the first
receiver (rank `senders`) down to the last, so the first replica's link
carries the whole push however many trainer ranks send: with every rank
sending its own rows (trainer/gather/own_rows.py) that link, not the
trainer's, became the limit (bench/push_links.py: 207 MB out of the first
replica, 52 MB out of each of 4 trainer links). In a ring, bucket k enters
at `starts[k % len(starts)]` (each replica's first worker rank) and goes
round the receivers, rank `senders` .. `world_size - 1` and back to rank
`senders`, ending at the rank before its entry: every receiver still gets
every bucket, each replica's link relays (R - 1) / R of the push instead of
the first one relaying all of it, and a bucket crosses between replicas
R - 1 times, as in a chain (entries at replica boundaries only, so a
replica's own workers stay consecutive on every bucket's way).

gloo only (NCCL's fused steps relay one chain: chain_steps.py). Every rank
computes the same routes from the manifest and `starts`, so each pair of
ranks posts its messages in bucket order on both sides, which is how gloo
matches them.
"""

from __future__ import annotations

from collections.abc import Sequence


def entry(k: int, senders: int, starts: Sequence[int] | None) -> int:
    """The receiver rank bucket `k` enters at: the trainer sends it there."""
    return starts[k % len(starts)] if starts else senders


def route(k: int, rank: int, sender: int, senders: int, world_size: int,
          starts: Sequence[int] | None) -> tuple[int, int | None]:
    """Receiver `rank`'s view of bucket `k` (sent by trainer rank `sender`):
    the rank it comes from, and the rank it goes on to (None: `rank` is
    the last on its way)."""
    start = entry(k, senders, starts)
    prev = rank - 1 if rank > senders else world_size - 1
    nxt = rank + 1 if rank + 1 < world_size else senders
    return (sender if rank == start else prev), (None if nxt == start else nxt)


def check_starts(starts: Sequence[int], senders: int, world_size: int) -> str | None:
    """What is wrong with `starts` for a group (None: nothing)."""
    if not starts:
        return "empty: leave it out for one chain"
    if list(starts) != sorted(set(starts)):
        return f"{list(starts)}: must be increasing, each rank once"
    if starts[0] < senders or starts[-1] >= world_size:
        return (f"{list(starts)}: every entry must be a receiver's rank, "
                f"{senders} .. {world_size - 1}")
    return None
