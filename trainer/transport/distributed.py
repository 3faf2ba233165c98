"""Bucket bytes over torch.distributed: gloo on CPU, NCCL on GPU.

A two-rank group of its own (trainer rank 0 = sender, the vLLM worker = 1),
rendezvoused through the server's TCPStore, so it never touches the trainer's
FSDP process group. Sends are asynchronous; the pusher waits on a bucket's
send only before reusing its buffer. The group's timeout is the server's push
deadline, so a dead server raises on this side as well.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any
from urllib.parse import urlparse

import torch

from rollout_sidecar.trainer.admin_client import WeightAdminClient, WeightPushError
from rollout_sidecar.trainer.transport.pair_group import SERVER_RANK, TRAINER_RANK, pair_group


class DistributedTransport:
    name = "gloo"
    checksum_in_request = False  # the CRCs go with the commit

    def __init__(self, admin: WeightAdminClient, backend: str = "gloo",
                 data_plane_host: str | None = None, takeover: bool = False,
                 lease_wait_s: float = 60.0) -> None:
        self.admin = admin
        self.backend = backend
        self.name = backend
        self.host = data_plane_host or urlparse(admin.base_url).hostname or "127.0.0.1"
        self.takeover = takeover
        self.lease_wait_s = lease_wait_s
        self.group: Any = None
        self.connection_id: str | None = None

    @property
    def buffer_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def ensure_connected(self, status: Any) -> None:
        """(Re)build the group if the server does not hold ours (first push,
        a failed one, which drops the group on both sides, or a restart)."""
        if self.group is not None and status.connected == self.connection_id:
            return
        self.group = None
        conn_id = self.connection_id = uuid.uuid4().hex[:12]
        timeout_s = status.push_timeout_s
        # The server's /weights/connect returns only once both sides joined the
        # group, so the two run side by side; a refused connect (another
        # trainer owns the plane) fails at once instead of waiting out the join.
        out: dict[str, Any] = {}

        def call_connect() -> None:
            try:
                self.admin.connect(conn_id, self.backend, timeout_s, self.takeover,
                                   self.lease_wait_s)
            except BaseException as e:
                out["connect_error"] = e

        def join() -> None:
            try:
                out["group"] = pair_group(self.host, status.data_plane_port, conn_id,
                                          TRAINER_RANK, self.backend, timeout_s)
            except BaseException as e:
                out["join_error"] = e

        connecting = threading.Thread(target=call_connect, daemon=True)
        joining = threading.Thread(target=join, daemon=True)
        connecting.start()
        joining.start()
        connecting.join()  # bounded: the server caps the connect, the client times out
        if "connect_error" in out:  # an abandoned join ends by its own timeout
            raise WeightPushError(f"connect failed: {out['connect_error']}"
                                  ) from out["connect_error"]
        joining.join(timeout_s)
        if "group" not in out:
            e = out.get("join_error")
            raise WeightPushError(f"data plane {self.host}:{status.data_plane_port}: "
                                  f"{e or 'join did not finish'}") from e
        self.group = out["group"]

    def send(self, index: int, buf: torch.Tensor, push_id: str, checksum: int | None) -> Any:
        return self.group.send([buf], SERVER_RANK, index)

    def reset(self) -> None:
        self.group = None
