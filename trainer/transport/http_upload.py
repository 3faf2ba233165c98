"""Bucket bytes as HTTP request bodies: for clusters where only the HTTP port
is open between trainer and server. Slower than gloo (an extra copy through
the API process, and one upload per replica), but needs nothing beyond the
control plane."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_pieces import Span
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins

if TYPE_CHECKING:
    from rollout_sidecar.trainer.push_config import PushConfig


class _Done:
    def wait(self) -> None:
        pass


class HttpUploadTransport:
    name = "http"
    route = "http"
    buffer_device = torch.device("cpu")
    checksum_in_request = True  # sent as the X-Checksum header of each bucket
    connection_id = None
    bucket_macs = None  # admin-authenticated HTTPS requests carry the buckets

    def __init__(self, replicas: ReplicaAdmins) -> None:
        self.replicas = replicas

    @classmethod
    def from_config(cls, name: str, replicas: ReplicaAdmins, config: PushConfig
                    ) -> HttpUploadTransport:
        return cls(replicas)

    def ensure_connected(self, statuses: list[Any]) -> None:
        pass  # every bucket is a request of its own: nothing to hold open

    def start_push(self, version: int) -> None:
        pass

    slot_pieces = False  # a bucket is one request body

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: Sequence[Span] | None = None) -> Any:
        """`push_ids`: each replica's id of this push, in replica order."""
        data = memoryview(buf.numpy()).tobytes()
        assert checksum is not None  # checksum_in_request: computed before the send
        self.replicas.all(lambda admin, i: admin.put_bucket(push_ids[i], index, data, checksum),
                          f"bucket {index}")
        return _Done()

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass  # no connection held
