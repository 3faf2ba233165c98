"""The data plane's process group: trainer rank 0 plus one server worker,
rendezvoused under a connection id through the server's TCPStore. Both sides
build it here, so both get the same name, ranks and timeout.

NCCL gets its timeout through its options (the plain constructor has none), so
a dead peer raises after the deadline on both backends instead of hanging.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

TRAINER_RANK, SERVER_RANK = 0, 1


def pair_group(host: str, port: int, connection_id: str, rank: int, backend: str,
               timeout_s: float) -> Any:
    """Blocks until the peer joins or `timeout_s` passes (then raises)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"rs/{connection_id}/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
