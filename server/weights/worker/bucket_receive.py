"""One push's buckets arriving over the data plane, in a background thread of
the vLLM worker (the engine core keeps scheduling generation meanwhile).

Each bucket's CRC (and keyed tag) is computed as it lands, while the next one
arrives, so the check has nothing left to read. A thread's current CUDA
device is its own and starts at device 0, so the thread sets the worker's
device before any collective: NCCL puts a collective's communicator on the
current device, and with TP >= 2 every worker would otherwise use GPU 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_group import receive_bucket
from rollout_sidecar.protocol.data_plane.bucket_mac import BucketMac
from rollout_sidecar.protocol.data_plane.wire_format import crc32
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.weights.worker.staging import StagedBucket

log = logging.getLogger(__name__)


class ReceiveThread(threading.Thread):
    """One push's receive: its thread, the group it reads and its error, kept
    apart from the next push's (a stale receive on a dropped group may end
    late, and must not fail a push that came after it)."""

    def __init__(self, group: Any, run: Callable[[ReceiveThread], None]) -> None:
        super().__init__(target=lambda: self._guarded(run), daemon=True,
                         name="rollout-sidecar-recv")
        self.group = group
        self.error: BaseException | None = None

    def _guarded(self, run: Callable[[ReceiveThread], None]) -> None:
        try:
            run(self)
        except BaseException as e:  # reported by SideOp.STATE and WorkerOp.CHECK
            self.error = e
            log.warning("weight receive failed: %s", e)


def use_device(device: torch.device, backend: str) -> None:
    """Make `device` this thread's current CUDA device (module docstring)."""
    if transport(backend).on_device and device.type == "cuda":
        torch.cuda.set_device(device)


def receive_broadcast(group: Any, buckets: list[StagedBucket], backend: str,
                      device: torch.device, key: bytes | None) -> None:
    """Every bucket, as a broadcast from the trainer's rank 0."""
    use_device(device, backend)
    pending = None
    bounce = host_copy = None
    if buckets and transport(backend).on_device:
        size = max(b.nbytes for b in buckets)
        if buckets[0].buffer.is_cpu:  # host staging: through the device
            bounce = torch.empty(size, dtype=torch.uint8, device=device)
        else:  # device staging: CRC'd here, from a host copy, not at CHECK
            host_copy = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    for b in buckets:
        target = b.buffer if bounce is None else bounce[: b.nbytes]
        work = group.broadcast(target)
        if pending is not None:  # the previous bucket, while this one arrives
            _digest(pending, key, host_copy)
        work.wait()
        if bounce is not None:
            b.buffer.copy_(target)  # synchronous: the next broadcast reuses it
        b.received = True
        pending = b
    if pending is not None:
        _digest(pending, key, host_copy)


def receive_chain(group: Any, buckets: list[StagedBucket], rank: int, world_size: int,
                  key: bytes | None) -> None:
    """Each bucket from the previous rank, forwarded to the next; its CRC
    runs over each piece while the next one arrives (gloo only)."""
    for b in buckets:
        crc = 0
        mac = BucketMac(key) if key is not None else None

        def add(piece: torch.Tensor, mac: BucketMac | None = mac) -> None:
            nonlocal crc
            crc = crc32(piece, crc)
            if mac is not None:
                mac.update(piece)

        receive_bucket(group, b.buffer, rank, world_size, "chain", add)
        b.checksum = crc
        b.mac = mac
        b.received = True


def _digest(b: StagedBucket, key: bytes | None, host_copy: torch.Tensor | None) -> None:
    """A bucket's CRC (and tag): a device bucket through one reused pinned
    host copy, so the check (on the worker's main thread) copies nothing."""
    data = b.buffer
    if not data.is_cpu:
        assert host_copy is not None
        data = host_copy[: b.nbytes]
        data.copy_(b.buffer)
    b.checksum = crc32(data)
    b.mac = BucketMac(key).update(data) if key is not None else None
