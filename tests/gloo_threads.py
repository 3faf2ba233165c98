"""A real gloo data-plane group of threads, one per rank, for unit tests of
the relays (chain_steps.py, ring_route.py): each rank's body runs with its
group, which is closed after it; every rank has a deadline, and any rank's
error fails the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group


def run_ranks(world: int, name: str, body: Callable[[int, Any], None],
              deadline_s: float = 90) -> None:
    """`body(rank, group)` on every rank at once; raises if any rank failed
    or did not finish within `deadline_s`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = broadcast_group("127.0.0.1", store.port, name, rank, world, "gloo", 30)
            try:
                body(rank, group)
            finally:
                group.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a rank did not finish in {deadline_s}s"
