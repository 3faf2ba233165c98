"""The ways a push's bytes reach a worker's staging, one `ReceivePath` each:
the server's half of a transport, named by its row in protocol/transports.py
(`receive`). The transfer engine (transfer_engine.py) opens a push with the
path of the push's transport and asks it where the buckets land and how
they arrive, instead of telling transports apart.

- `GroupReceive` (gloo, NCCL): the trainer's data-plane group, in a
  background thread that CRCs (and tags) each bucket as it lands
  (bucket_receive.py): a broadcast from the trainer's rank 0, or a chain,
  where each replica forwards what it got (gloo's threads, NCCL's fused
  steps), from one trainer rank or from every one.
- `HttpStage` (HTTP): the bytes the API process took from a request body,
  handed over as one `WorkerOp.STAGE` per bucket, checked as they land.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rollout_sidecar.protocol.schema import Check
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.weights.worker.bucket_receive import (
    ReceiveThread,
    receive_broadcast,
    receive_chain,
)
from rollout_sidecar.server.weights.worker.group_membership import GroupMembership
from rollout_sidecar.server.weights.worker.staging import Staging

HOST = torch.device("cpu")


class ReceivePath(Protocol):
    """A transport's receive, opened once per push on each worker."""

    def __init__(self, connection: GroupMembership, device: torch.device) -> None: ...

    def staging_device(self, small: bool) -> torch.device:
        """Where the push's buckets land (`small`: patches, applied on the host)."""
        ...

    def start(self, staging: Staging, check: Check = "crc32") -> ReceiveThread | None:
        """Start receiving into `staging`'s buckets: the thread that does, or
        None when they are handed over op by op."""
        ...


class GroupReceive:
    """Buckets over the trainer's group, which this worker joined at connect."""

    def __init__(self, connection: GroupMembership, device: torch.device) -> None:
        if connection.group is None:
            raise RuntimeError("data plane not connected; call /weights/connect first")
        self.connection = connection
        self.device = device

    def staging_device(self, small: bool) -> torch.device:
        """Where the buckets land. gloo moves host memory. NCCL receives into
        device memory, but a full staged copy there sits outside vLLM's memory
        budget, so by default it goes through a one-bucket device buffer into
        pinned host memory. `small` pushes (a delta's or an adapter's
        patches) are applied on the host."""
        c, info = self.connection, self.connection.info
        if transport(c.backend).on_device and info is not None and info.staging == "device" \
                and not small:
            return self.device
        return HOST

    def start(self, staging: Staging, check: Check = "crc32") -> ReceiveThread:
        """Receive every bucket in a background thread, started here."""
        c = self.connection
        j = c.joiner
        assert j is not None

        def run(rx: ReceiveThread) -> None:
            i = j.info
            if i.fanout == "chain":
                receive_chain(rx.group, staging, j.rank, i.world_size, i.mac_key, i.senders,
                              check, c.backend, self.device, i.ring_starts, i.slot_pieces)
            else:
                receive_broadcast(rx.group, staging, c.backend, self.device, i.mac_key, check)

        receiver = ReceiveThread(c.group, run)
        receiver.start()
        return receiver


class HttpStage:
    """Buckets as HTTP bodies, handed over one op at a time."""

    def __init__(self, connection: GroupMembership, device: torch.device) -> None:
        pass  # no group, no device: the API process hands the bytes over

    def staging_device(self, small: bool) -> torch.device:
        return HOST

    def start(self, staging: Staging, check: Check = "crc32") -> None:
        return None  # the bytes come as STAGE ops (`stage`)

    @staticmethod
    def stage(staging: Staging, bucket: int | None, data: bytes | bytearray | None,
              check: Check, key: bytes | None) -> None:
        """Copy one bucket's bytes in (checked, and tagged with the
        connection's `key`, as they land); a re-sent bucket replaces the old."""
        if bucket is None or data is None:
            raise ValueError("stage needs bucket and data")
        if not 0 <= bucket < len(staging.buckets):
            raise ValueError(f"bucket {bucket} is not in the manifest")
        # A bytearray is read in place (frombuffer wants a writable buffer).
        writable = data if isinstance(data, bytearray) else bytearray(data)
        staging.stage(bucket, torch.frombuffer(writable, dtype=torch.uint8), check, key)
