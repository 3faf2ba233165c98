"""Bucket bytes as HTTP request bodies: for clusters where only the HTTP port
is open between trainer and server. Slower than gloo (an extra copy through
the API process), but needs nothing beyond the control plane."""

from __future__ import annotations

from typing import Any

import torch

from rollout_sidecar.trainer.admin_client import WeightAdminClient


class _Done:
    def wait(self) -> None:
        pass


class HttpTransport:
    name = "http"
    buffer_device = torch.device("cpu")
    checksum_in_request = True  # sent as the X-Checksum header of each bucket

    def __init__(self, admin: WeightAdminClient) -> None:
        self.admin = admin

    connection_id = None

    def ensure_connected(self, status: object) -> None:
        pass

    def send(self, index: int, buf: torch.Tensor, push_id: str, checksum: int | None) -> Any:
        self.admin.put_bucket(push_id, index, memoryview(buf.numpy()).tobytes(), checksum)
        return _Done()

    def reset(self) -> None:
        pass
