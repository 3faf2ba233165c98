"""A chain entered at a replica of its own per bucket (ring_route.py): the
routes every rank derives agree, a ring without starts is the old chain, and
a real gloo group of threads (2 trainer senders, a 2-worker replica and a
1-worker replica) relays every bucket to every receiver bit for bit, with
each replica's link relaying about half the push instead of the first one
relaying all of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_sidecar.protocol.data_plane.bucket_group import relay_buckets, send_bucket
from rollout_sidecar.protocol.data_plane.landing import InPlace
from rollout_sidecar.protocol.data_plane.ring_route import check_starts, entry, route
from tests.gloo_threads import run_ranks

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def walk(k: int, sender: int, senders: int, world: int, starts: list[int] | None) -> list[int]:
    """The receivers bucket k visits, following each one's own route."""
    at, seen = entry(k, senders, starts), []
    src = sender
    while at is not None:
        came, to = route(k, at, sender, senders, world, starts)
        assert came == src, (k, at, came, src)  # each hop's two ends agree
        seen.append(at)
        src, at = at, to
    return seen


def test_without_starts_every_bucket_goes_down_one_chain() -> None:
    for k in range(4):
        assert walk(k, k % 2, 2, 6, None) == [2, 3, 4, 5]


@pytest.mark.parametrize("starts", [[2, 4], [2, 3, 5], [2]])
def test_a_ring_visits_every_receiver_once_from_its_entry(starts: list[int]) -> None:
    world = 6
    for k in range(7):
        seen = walk(k, k % 2, 2, world, starts)
        assert sorted(seen) == [2, 3, 4, 5]
        assert seen[0] == starts[k % len(starts)]
        # a replica's workers stay consecutive: entries are replica boundaries
        assert seen == [r for r in range(seen[0], world)] + list(range(2, seen[0]))


@pytest.mark.parametrize("starts, why", [([], "empty"), ([4, 2], "increasing"),
                                         ([2, 2], "increasing"), ([1, 4], "receiver"),
                                         ([2, 6], "receiver")])
def test_bad_starts_are_named(starts: list[int], why: str) -> None:
    assert why in (check_starts(starts, 2, 6) or "")
    assert check_starts([2, 4], 2, 6) is None


class _Counting:
    """A gloo group that counts the bytes each rank sends on."""

    def __init__(self, group: Any, sent: list[int]) -> None:
        self.group, self.sent = group, sent

    def recv(self, piece: Any, src: int) -> Any:
        return self.group.recv(piece, src)

    def send(self, piece: Any, dst: int) -> Any:
        self.sent.append(piece.numel())
        return self.group.send(piece, dst)


def test_a_ring_reaches_every_receiver_bit_for_bit_and_splits_the_relaying() -> None:
    sizes = [9 * MiB, 5 * MiB + 3, 9 * MiB, 5 * MiB + 3, 1, 7]
    sources = [0, 1, 0, 1, 0, 1]
    senders, world, starts = 2, 5, [2, 4]  # replica A: ranks 2, 3; replica B: rank 4
    g = torch.Generator().manual_seed(0)
    buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    got: dict[int, list[torch.Tensor]] = {}
    sent: dict[int, list[int]] = {r: [] for r in range(world)}

    def body(rank: int, group: Any) -> None:
        if rank < senders:
            works = [send_bucket(group, b, "chain", first_receiver=entry(k, senders, starts))
                     for k, (b, s) in enumerate(zip(buckets, sources, strict=True)) if s == rank]
            for w in works:
                w.wait()
            return
        mine = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        relay_buckets(_Counting(group, sent[rank]),
                      [route(k, rank, s, senders, world, starts) for k, s in enumerate(sources)],
                      InPlace(mine), window=senders)
        got[rank] = mine

    run_ranks(world, "ring", body)
    assert sorted(got) == [2, 3, 4]
    for rank, mine in got.items():
        for k, (b, m) in enumerate(zip(buckets, mine, strict=True)):
            assert torch.equal(b, m), (rank, k)
    total = sum(sizes)
    # Between replicas: A's last worker relays the buckets entering at A (even
    # ones) to B, and B relays the odd ones to A: each about half, none all.
    assert sum(sent[3]) == sum(sizes[0::2]) and sum(sent[4]) == sum(sizes[1::2])
    assert max(sum(sent[3]), sum(sent[4])) < 0.7 * total
    assert sum(sent[2]) == total  # within replica A every bucket passes rank 2 on to 3
