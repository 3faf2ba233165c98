"""Bucket bytes over torch.distributed: gloo on CPU, NCCL on GPU.

A two-rank group of its own (trainer rank 0 = sender, the vLLM worker = 1),
rendezvoused through the server's TCPStore, so it never touches the trainer's
FSDP process group. Sends are asynchronous; the pusher waits on a bucket's
send only before reusing its buffer.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from typing import Any
from urllib.parse import urlparse

import torch

from rollout_sidecar.trainer.admin_client import WeightAdminClient, WeightPushError

SERVER_RANK = 1


class DistributedTransport:
    name = "gloo"
    checksum_in_request = False  # the CRCs go with the commit

    def __init__(self, admin: WeightAdminClient, backend: str = "gloo",
                 data_plane_host: str | None = None, timeout_s: float = 300.0) -> None:
        self.admin = admin
        self.backend = backend
        self.name = backend
        self.host = data_plane_host or urlparse(admin.base_url).hostname or "127.0.0.1"
        self.timeout_s = timeout_s
        self.group: Any = None
        self.connection_id: str | None = None

    @property
    def buffer_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def ensure_connected(self) -> None:
        """(Re)build the group if the server does not hold ours (first push,
        or after a failed one, which drops the group on both sides)."""
        status = self.admin.status()
        if self.group is not None and status.connected == self.connection_id:
            return
        self.group = None
        self.connection_id = f"{uuid.uuid4().hex[:12]}"
        # The server's /weights/connect returns only once we joined the group
        # from this side, so it runs in a thread while we join.
        err: list[BaseException] = []

        def call_connect() -> None:
            try:
                self.admin.connect(self.connection_id, self.backend, self.timeout_s)
            except BaseException as e:  # surfaced below
                err.append(e)

        t = threading.Thread(target=call_connect, daemon=True)
        t.start()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            store = torch.distributed.TCPStore(self.host, status.data_plane_port,
                                               is_master=False, timeout=timeout)
            prefixed = torch.distributed.PrefixStore(f"rs/{self.connection_id}/", store)
            if self.backend == "nccl":
                group = torch.distributed.ProcessGroupNCCL(prefixed, 0, 2)
            else:
                group = torch.distributed.ProcessGroupGloo(prefixed, 0, 2, timeout)
        except Exception as e:
            t.join(5)
            raise WeightPushError(f"data plane {self.host}:{status.data_plane_port}: {e}"
                                  ) from (err[0] if err else e)
        t.join(self.timeout_s)
        if err:
            raise WeightPushError(f"connect failed: {err[0]}") from err[0]
        self.group = group

    def send(self, index: int, buf: torch.Tensor, push_id: str, checksum: int | None) -> Any:
        return self.group.send([buf], SERVER_RANK, index)

    def reset(self) -> None:
        self.group = None
