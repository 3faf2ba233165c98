"""The data plane's process group: trainer rank 0 plus every worker of every
server replica, rendezvoused under a connection id through one server's
TCPStore. Both sides build it here, so both get the same name, ranks and
timeout. Each bucket leaves the trainer once, as a broadcast from rank 0.

Ranks: a server's workers sit at `rank_offset + dp_index * (TP * PP) + rank`
(vLLM's own NCCL engine numbers them the same way), and the trainer gives each
replica its offset, so N replicas of W workers make a group of 1 + N * W.

NCCL gets its timeout through its options (the plain constructor has none), so
a dead peer raises after the deadline on both backends instead of hanging.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch.distributed as dist

TRAINER_RANK = 0


def broadcast_group(host: str, port: int, connection_id: str, rank: int, world_size: int,
                    backend: str, timeout_s: float) -> Any:
    """Blocks until every rank joined or `timeout_s` passes (then raises)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"rs/{connection_id}/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def close_group(group: Any) -> None:
    """Abort the group's pending work and connections now. Left to the garbage
    collector, a group with a broken peer could be destroyed at interpreter
    exit with a gloo thread still joinable, which kills the process (SIGABRT:
    "terminate called without an active exception")."""
    if group is None:
        return
    with contextlib.suppress(Exception):
        group.abort()
