"""A worker's side of the weight data plane: the trainer's group it joined,
or, when its engine's TP workers share one staged copy (host_share.py), the
leader it follows (a follower joins nothing: the leader receives for both).

Joining blocks until every rank of the group joined, so it runs in a thread
of its own, which sets this worker's CUDA device first (bucket_receive.py);
the engine core keeps scheduling generation meanwhile, and the API process
polls the state (`SideOp.STATE`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group, close_group
from rollout_sidecar.protocol.data_plane.bucket_mac import parse_secret
from rollout_sidecar.server.weights.worker.bucket_receive import use_device


@dataclass
class StagedInitInfo(WeightTransferInitInfo):
    store_host: str
    store_port: int
    connection_id: str
    backend: str = "gloo"
    timeout_s: float = 300.0  # forming the group
    op_timeout_s: float | None = None  # each operation once formed (None: timeout_s)
    world_size: int = 2
    rank_offset: int = 1
    senders: int = 1  # trainer ranks in the group, 0 .. senders - 1 (bucket_group.py)
    staging: str = "auto"  # NCCL only: "device" stages in GPU memory, else pinned host
    fanout: str = "broadcast"  # or "chain" (gloo): see protocol/data_plane/bucket_group.py
    ring_starts: list[int] | None = None  # a chain entered per bucket here (ring_route.py)
    slot_pieces: bool = False  # gloo chain: a bucket holding a chunk comes slot by slot
    # The connection's data-plane key, hex (bucket_mac.py): out of every repr,
    # so no log of this dataclass shows it. None: an older trainer, CRC only.
    secret: str | None = field(default=None, repr=False)
    bucket_macs: bool = False  # with the secret: every bucket carries a tag

    @property
    def key(self) -> bytes | None:
        return parse_secret(self.secret) if self.secret is not None else None

    @property
    def mac_key(self) -> bytes | None:
        """The key to tag arriving buckets with, if this connection tags them."""
        return self.key if self.bucket_macs else None


class Joiner(threading.Thread):
    """Joins the trainer's group; blocks until every rank does, or times out."""

    def __init__(self, info: StagedInitInfo, plane_rank: int, device: torch.device) -> None:
        super().__init__(daemon=True, name="rollout-sidecar-connect")
        self.info = info
        self.rank = info.rank_offset + plane_rank
        self.device = device
        self.group: Any = None
        self.error: str | None = None

    def run(self) -> None:
        i = self.info
        try:
            use_device(self.device, i.backend)
            self.group = broadcast_group(i.store_host, i.store_port, i.connection_id,
                                         self.rank, i.world_size, i.backend, i.timeout_s,
                                         i.key, i.op_timeout_s, device=self.device)
        except BaseException as e:  # reported through SideOp.STATE
            self.error = f"{type(e).__name__}: {e}"



class GroupMembership:
    """The group this worker joined (or is joining), or the leader it follows."""

    def __init__(self) -> None:
        self.joiner: Joiner | None = None
        self.follows: StagedInitInfo | None = None

    def open(self, info: StagedInitInfo, plane_rank: int | None, device: torch.device
             ) -> None:
        """Start joining as this server's data-plane rank `plane_rank` (None:
        follow the leader, who receives) and return at once."""
        self.close()
        if plane_rank is None:
            self.follows = info
            return
        self.joiner = Joiner(info, plane_rank, device)
        self.joiner.start()

    @property
    def info(self) -> StagedInitInfo | None:
        return self.joiner.info if self.joiner is not None else self.follows

    @property
    def group(self) -> Any:
        return self.joiner.group if self.joiner is not None else None

    @property
    def backend(self) -> str:
        return self.joiner.info.backend if self.joiner is not None else "gloo"

    def state(self) -> dict:
        j = self.joiner
        if self.follows is not None:  # nothing to join: the leader receives
            return {"state": "connected", "id": self.follows.connection_id}
        if j is None:
            return {"state": "none"}
        if j.group is not None:
            return {"state": "connected", "id": j.info.connection_id}
        if j.error is not None:
            return {"state": "failed", "id": j.info.connection_id, "error": j.error}
        return {"state": "connecting", "id": j.info.connection_id}

    def drop_group(self) -> None:
        """Aborted, not left to the garbage collector: a receive still blocked
        on a dead trainer returns at once, and no gloo thread outlives it. A
        joiner still blocked in the rendezvous ends by its own timeout."""
        if self.joiner is not None:
            close_group(self.joiner.group)
        self.joiner = None

    def close(self) -> None:
        self.drop_group()
        self.follows = None
