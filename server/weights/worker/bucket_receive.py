"""One push's buckets arriving over the data plane, in a background thread of
the vLLM worker (the engine core keeps scheduling generation meanwhile).

Each bucket's check value (and keyed tag) is computed as it lands, while the
next one arrives, so the check has nothing left to read. A thread's current CUDA
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

from rollout_sidecar.protocol.data_plane.bucket_check import BucketCheck, bucket_check
from rollout_sidecar.protocol.data_plane.bucket_group import relay_buckets
from rollout_sidecar.protocol.data_plane.bucket_mac import BucketMac
from rollout_sidecar.protocol.data_plane.chain_steps import relay_steps
from rollout_sidecar.protocol.data_plane.ring_route import route
from rollout_sidecar.protocol.schema import Check
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
                      device: torch.device, key: bytes | None, check: Check = "crc32") -> None:
    """Every bucket, as a broadcast from the trainer's rank 0. An NCCL
    bucket's `sum64` is computed in device memory (bucket_check.py): no host
    copy unless a CRC-32 or a tag needs one."""
    use_device(device, backend)
    chk = bucket_check(check)
    pending = None
    bounce = host_copy = None
    if buckets and transport(backend).on_device:
        size = max(b.nbytes for b in buckets)
        if buckets[0].buffer.is_cpu:  # host staging: through the device
            bounce = torch.empty(size, dtype=torch.uint8, device=device)
        elif chk.needs_host_copy(tagged=key is not None):  # device staging: a copy to read
            host_copy = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    for b in buckets:
        target = b.buffer if bounce is None else bounce[: b.nbytes]
        work = group.broadcast(target)
        if pending is not None:  # the previous bucket, while this one arrives
            _digest(pending, key, host_copy, chk)
        work.wait()
        if bounce is not None:
            if chk.on_device:  # where the bytes are, before they leave the device
                b.checksum = chk.compute(target)
            b.buffer.copy_(target)  # synchronous: the next broadcast reuses it
        b.received = True
        pending = b
    if pending is not None:
        _digest(pending, key, host_copy, chk)


def receive_chain(group: Any, buckets: list[StagedBucket], rank: int, world_size: int,
                  key: bytes | None, senders: int = 1, check: Check = "crc32",
                  backend: str = "gloo", device: torch.device | None = None,
                  ring_starts: list[int] | None = None) -> None:
    """Each bucket from its sender (the first receiver, rank `senders`) or
    the previous rank, forwarded to the next; a CRC-32 runs over each piece
    while the next one arrives. With several senders a bucket from each is on
    the way at once: gloo's `relay_buckets`, NCCL's fused steps
    (`relay_steps`; host staging lands through device slots, and a device
    piece is CRC'd through a host copy: a GPU trainer speaks `sum64`). With
    `ring_starts` (gloo), bucket k enters at a replica of its own and goes
    round (protocol/data_plane/ring_route.py)."""
    routes = [(b.buffer, *route(k, rank, b.source, senders, world_size, ring_starts))
              for k, b in enumerate(buckets)]
    chk = bucket_check(check)
    running = chk.running  # piece by piece as they arrive, if the check can
    values = [0] * len(buckets)
    macs = [BucketMac(key) if key is not None else None for _ in buckets]

    def add(k: int, piece: torch.Tensor) -> None:
        if running is not None:
            values[k] = running(piece, values[k])
        mac = macs[k]
        if mac is not None:
            mac.update(piece)
        if piece.data_ptr() + piece.numel() == buckets[k].buffer.data_ptr() + buckets[k].nbytes:
            buckets[k].received = True  # its last piece

    if transport(backend).on_device:
        if device is not None:
            use_device(device, backend)
        relay_steps(group, [(b.buffer, b.source) for b in buckets], rank, world_size,
                    first_receiver=senders, on_piece=add)
    else:
        relay_buckets(group, routes, window=senders, on_piece=add)
    for k, b in enumerate(buckets):
        b.checksum = values[k] if running is not None else chk.compute(b.buffer)
        b.mac = macs[k]
        b.received = True


def _digest(b: StagedBucket, key: bytes | None, host_copy: torch.Tensor | None,
            chk: BucketCheck) -> None:
    """A bucket's check value (and tag): a device check where the bucket is;
    a host check or tag of a device bucket through one reused pinned host
    copy, so the check (on the worker's main thread) copies nothing."""
    data = b.buffer
    if chk.on_device and b.checksum is None:
        b.checksum = chk.compute(data)
    if not chk.needs_host_copy(tagged=key is not None):
        return
    if not data.is_cpu:
        assert host_copy is not None
        data = host_copy[: b.nbytes]
        data.copy_(b.buffer)
    if not chk.on_device:
        b.checksum = chk.compute(data)
    b.mac = BucketMac(key).update(data) if key is not None else None
