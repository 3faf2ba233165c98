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
from rollout_sidecar.protocol.data_plane.bucket_pieces import cut, even, spans
from rollout_sidecar.protocol.data_plane.chain_steps import relay_steps
from rollout_sidecar.protocol.data_plane.ring_route import route
from rollout_sidecar.protocol.schema import Check
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.weights.worker.staging import Receipt, Staging

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


class Arrivals:
    """A worker's `Landing` (protocol/data_plane/landing.py): each bucket
    arrives in its staged buffer; a scattered one (placed_tensors.py) either
    slot by slot straight into its places (`slot_pieces`), or in a lent
    buffer whose slots go to their places once it is all here, while the
    next one arrives. Its check value (and tag) runs over its pieces as they
    land."""

    def __init__(self, staging: Staging, key: bytes | None, check: Check,
                 slot_pieces: bool = False) -> None:
        self.receipt, self.chk = staging.receipt(), bucket_check(check)
        self.slot_pieces = slot_pieces  # scattered buckets come slot by slot
        n = len(self.receipt.buckets)
        self.values = [0] * n
        self.got = [0] * n
        self.macs = [BucketMac(key) if key is not None else None for _ in range(n)]
        self.lent: dict[int, torch.Tensor] = {}

    def buffer(self, k: int) -> torch.Tensor:
        self.lent[k] = self.receipt.buffer(k)
        return self.lent[k]

    def pieces(self, k: int) -> list[torch.Tensor]:
        """Cut slot by slot, a scattered bucket's pieces land in place where
        its check runs piece by piece (CRC-32), else in a lent buffer."""
        b = self.receipt.buckets[k]
        if not (self.slot_pieces and b.scattered):
            return even(self.buffer(k))
        if self.chk.running is not None:
            return self.receipt.in_place(k)
        return cut(self.buffer(k), spans(b.nbytes, b.params))

    def piece(self, k: int, piece: torch.Tensor) -> None:
        running = self.chk.running
        if running is not None:
            self.values[k] = running(piece, self.values[k])
        mac = self.macs[k]
        if mac is not None:
            mac.update(piece)
        self.got[k] += piece.numel()
        if self.got[k] == self.receipt.buckets[k].nbytes:
            data = self.lent.get(k)  # None: landed in place
            if running is not None:
                value = self.values[k]
            else:
                assert data is not None, "in place only with a running check"
                value = self.chk.compute(data)
            self.receipt.arrived(k, data, value, mac)

    def passed_on(self, k: int) -> None:
        if k in self.lent:
            self.receipt.give_back(k, self.lent.pop(k))

    def finish(self) -> None:
        """Every bucket arrived (an empty one has no piece to say so)."""
        for k, b in enumerate(self.receipt.buckets):
            if not b.received:
                if b.nbytes:
                    raise RuntimeError(f"bucket {b.index}: {self.got[k]} of {b.nbytes} bytes "
                                       "arrived")
                nothing = torch.empty(0, dtype=torch.uint8)
                self.receipt.arrived(k, nothing, self.chk.compute(nothing), self.macs[k])


def receive_broadcast(group: Any, staging: Staging, backend: str, device: torch.device,
                      key: bytes | None, check: Check = "crc32") -> None:
    """Every bucket, as a broadcast from the trainer's rank 0. An NCCL
    bucket's `sum64` is computed in device memory (bucket_check.py): no host
    copy unless a CRC-32 or a tag needs one. A bucket is digested (and a
    scattered one lands in its places) while the next one arrives."""
    use_device(device, backend)
    chk = bucket_check(check)
    receipt = staging.receipt()
    buckets = receipt.buckets
    pending: tuple[int, torch.Tensor, int | None] | None = None
    bounce = host_copy = None
    if buckets and transport(backend).on_device:
        size = max(b.nbytes for b in buckets)
        if staging.device.type == "cpu":  # host staging: through the device
            bounce = torch.empty(size, dtype=torch.uint8, device=device)
        elif chk.needs_host_copy(tagged=key is not None):  # device staging: a copy to read
            host_copy = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    for k, b in enumerate(buckets):
        buf = receipt.buffer(k)
        target = buf if bounce is None else bounce[: b.nbytes]
        work = group.broadcast(target)
        if pending is not None:  # the previous bucket, while this one arrives
            _digest(receipt, *pending, key, host_copy, chk)
        work.wait()
        value = None
        if bounce is not None:
            if chk.on_device:  # where the bytes are, before they leave the device
                value = chk.compute(target)
            buf.copy_(target)  # synchronous: the next broadcast reuses it
        pending = (k, buf, value)
    if pending is not None:
        _digest(receipt, *pending, key, host_copy, chk)


def receive_chain(group: Any, staging: Staging, rank: int, world_size: int,
                  key: bytes | None, senders: int = 1, check: Check = "crc32",
                  backend: str = "gloo", device: torch.device | None = None,
                  ring_starts: list[int] | None = None, slot_pieces: bool = False) -> None:
    """Each bucket from its sender (the first receiver, rank `senders`) or
    the previous rank, forwarded to the next; a CRC-32 runs over each piece
    while the next one arrives (`Arrivals`). With several senders a bucket
    from each is on the way at once: gloo's `relay_buckets`, NCCL's fused
    steps (`relay_steps`; host staging lands through device slots, and a
    device piece is CRC'd through a host copy: a GPU trainer speaks
    `sum64`). With `ring_starts` (gloo), bucket k enters at a replica of
    its own and goes round (protocol/data_plane/ring_route.py). With
    `slot_pieces` (gloo), a bucket holding a chunk comes slot by slot and
    each slot lands in its place, with no receive buffer (bucket_pieces.py)."""
    landing = Arrivals(staging, key, check, slot_pieces)
    buckets = landing.receipt.buckets
    if transport(backend).on_device:
        if device is not None:
            use_device(device, backend)
        relay_steps(group, [(b.nbytes, b.source) for b in buckets], landing, rank, world_size,
                    first_receiver=senders, on_host=staging.device.type == "cpu")
    else:
        relay_buckets(group, [route(k, rank, b.source, senders, world_size, ring_starts)
                              for k, b in enumerate(buckets)], landing, window=senders)
    landing.finish()


def _digest(receipt: Receipt, k: int, data: torch.Tensor, value: int | None,
            key: bytes | None, host_copy: torch.Tensor | None, chk: BucketCheck) -> None:
    """Bucket k's check value (and tag), then its arrival (a scattered
    bucket's slots to their places): a device check where the bucket is; a
    host check or tag of a device bucket through one reused pinned host
    copy, so the check (on the worker's main thread) copies nothing; a lent
    buffer goes back once landed."""
    if chk.on_device and value is None:
        value = chk.compute(data)
    mac = None
    if chk.needs_host_copy(tagged=key is not None):
        host = data
        if not data.is_cpu:
            assert host_copy is not None
            host = host_copy[: data.numel()]
            host.copy_(data)
        if not chk.on_device:
            value = chk.compute(host)
        mac = BucketMac(key).update(host) if key is not None else None
    receipt.arrived(k, data, value, mac)
    receipt.give_back(k, data)
