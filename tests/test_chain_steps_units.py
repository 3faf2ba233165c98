"""NCCL's chain of several senders (data_plane/chain_steps.py), run on a real
gloo group of threads: the fused-step schedule is the same whichever group
runs it, so the order every pair of ranks posts its pieces in, which NCCL
matches exactly as gloo does, is proven here; only the NCCL calls themselves
need a GPU (tests/gpu/test_data_plane_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_sidecar.protocol.data_plane.bucket_group import send_bucket
from rollout_sidecar.protocol.data_plane.bucket_pieces import CHAIN_CHUNK_BYTES
from rollout_sidecar.protocol.data_plane.chain_steps import chain_steps, relay_steps
from rollout_sidecar.protocol.data_plane.landing import InPlace
from tests.gloo_threads import run_ranks

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_each_step_takes_the_next_piece_of_every_sender_in_its_order() -> None:
    sizes = [40 * MiB, 3, 20 * MiB, 16 * MiB, 0]
    senders = [0, 0, 1, 0, 1]
    steps = chain_steps(list(zip(sizes, senders, strict=True)))
    for step in steps:
        assert len({p.source for p in step}) == len(step)  # one piece per sender
    for s in (0, 1):  # a sender's pieces, step after step: its buckets' order, cut as it cuts
        mine = [(p.bucket, p.start, p.stop) for step in steps for p in step if p.source == s]
        expected = [(k, i, min(i + CHAIN_CHUNK_BYTES, n))
                    for k, (n, who) in enumerate(zip(sizes, senders, strict=True)) if who == s
                    for i in range(0, n, CHAIN_CHUNK_BYTES)]
        assert mine == expected
    assert len(steps) == 5  # sender 0 has 3 + 1 + 1 pieces, sender 1 has 2


class _WithSlots:
    """A gloo group that says it has a device: host buffers then land through
    the slots, as a host-staged NCCL receive does (on the CPU here)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.device = torch.device("cpu")

    def exchange(self, sends: Any, recvs: Any) -> Any:
        return self.group.exchange(sends, recvs)


@pytest.mark.parametrize("slots", [False, True], ids=["in-place", "through-slots"])
def test_two_senders_reach_every_relay_bit_for_bit(slots: bool) -> None:
    sizes = [40 * MiB, 5 * MiB + 3, 17 * MiB, 1]
    sources = [0, 1, 1, 0]  # sender 1 has two buckets in a row: per-pair order matters
    g = torch.Generator().manual_seed(0)
    buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    senders, receivers = 2, 3
    world = senders + receivers
    got: dict[int, list[torch.Tensor]] = {}
    seen: dict[int, list[tuple[int, int]]] = {}

    def body(rank: int, group: Any) -> None:
        if rank < senders:
            works = [send_bucket(group, b, "chain", first_receiver=senders)
                     for b, s in zip(buckets, sources, strict=True) if s == rank]
            for w in works:
                w.wait()
            return
        mine = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        seen[rank] = []
        relay_steps(_WithSlots(group) if slots else group,
                    list(zip(sizes, sources, strict=True)),
                    InPlace(mine, lambda k, p: seen[rank].append((k, p.numel()))), rank, world,
                    senders, on_host=True)
        got[rank] = mine

    run_ranks(world, f"steps-{slots}", body)
    assert sorted(got) == [2, 3, 4]
    for rank, mine in got.items():
        for k, (b, m) in enumerate(zip(buckets, mine, strict=True)):
            assert torch.equal(b, m), (rank, k)
        # Each bucket's pieces, in order, each where it belongs (the CRC runs over them so).
        for k, n in enumerate(sizes):
            assert sum(size for j, size in seen[rank] if j == k) == n
