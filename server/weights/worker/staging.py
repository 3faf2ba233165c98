"""Staging of one push, in host memory (or, for NCCL with `staging=device`,
GPU memory): per-bucket buffers, checksums, views.

Buckets land here and are checked while the old weights keep serving. Only a
complete, checked set is ever loaded into the model, which is what makes a
commit atomic. Buffers are kept for the next push of the same layout, so a
steady-state push allocates nothing; a pooled buffer the next push's layout
does not use is freed then, so a Staging never holds more than one push's
buffers (a delta's patch buckets change size at every push: pooled by size
and never trimmed, they piled up push after push).

Pinned memory (a GPU server): only the staged copy (`pinned=True`), whose
buffers go host-to-device at every load, and the buffers its buckets that
hold a chunk arrive in (a GPU's receive slots copy into them). It comes from PyTorch's caching host
allocator (`pin_memory=True`), which rounds each block up to a power of two
and keeps freed blocks cached for reuse, never returning them
(c10/cuda/CUDACachingHostAllocator.cpp); so a pool buffer freed here is also
released from that cache (`_host_emptyCache`), and a delta's patches, applied
on the host and never copied to the GPU, are not pinned at all. The staged
copy's bucket sizes repeat from push to push, so its pool reallocates nothing.

A tensor larger than a bucket arrives split across buckets, and with every
trainer rank sending its own FSDP2 rows every sharded tensor arrives as one
chunk per rank. A bucket that holds a chunk is not kept: it arrives in a lent
buffer and its slots are copied to their tensors' places as it lands
(placed_tensors.py), so every tensor a load hands vLLM is a view, split or
not, and the load copies nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_check import checksum
from rollout_sidecar.protocol.data_plane.bucket_mac import BucketMac, same_tag
from rollout_sidecar.protocol.data_plane.bucket_pieces import holds_chunk, spans
from rollout_sidecar.protocol.data_plane.wire_format import slot_tensor
from rollout_sidecar.protocol.schema import BucketManifest, Check, TensorSlot
from rollout_sidecar.server.weights.worker.host_share import SharedBuffers
from rollout_sidecar.server.weights.worker.placed_tensors import Places, ReceiveBuffers, land

_UNMAPPED = torch.empty(0, dtype=torch.uint8)  # a follower's bucket between loads


@dataclass
class StagedBucket:
    index: int
    nbytes: int
    params: list[TensorSlot]
    buffer: torch.Tensor
    received: bool = False
    checksum: int | None = None  # computed on arrival
    mac: Any = None  # BucketMac, fed on arrival (a connection with a secret)
    source: int = 0  # the trainer's data-plane rank that sends it (BucketManifest.sender)
    # It holds a chunk: its slots live in their tensors' places (placed_tensors.py),
    # and `buffer` is empty but while it arrives (a lent one).
    scattered: bool = False


@dataclass(frozen=True)
class Receipt:
    """One push's buckets, places and receive buffers, as its receive holds
    them: a stale receive, still blocked on a dead trainer after a discard,
    writes only into what its push was given (`drop_pool` gives the next
    push new ones), never into the next push's staging."""

    buckets: list[StagedBucket]
    places: dict[str, torch.Tensor]
    lent: ReceiveBuffers

    def buffer(self, k: int) -> torch.Tensor:
        """Where bucket `k` arrives: its own buffer, or a lent one."""
        b = self.buckets[k]
        return self.lent.lend(b.nbytes) if b.scattered else b.buffer

    def in_place(self, k: int) -> list[torch.Tensor]:
        """Where scattered bucket `k`'s pieces, cut slot by slot
        (bucket_pieces.py), land: each slot's straight in its tensor's
        place, each gap between slots in a few bytes of its own."""
        b = self.buckets[k]
        slots = sorted(b.params, key=lambda p: p.offset)
        out, i = [], 0
        for start, stop in spans(b.nbytes, slots):
            while i < len(slots) and slots[i].offset + slots[i].length <= start:
                i += 1
            p = slots[i] if i < len(slots) and slots[i].offset <= start else None
            if p is None:  # alignment: received, checked, not kept
                out.append(torch.empty(stop - start, dtype=torch.uint8))
                continue
            at = (p.chunk_offset or 0) + start - p.offset
            out.append(self.places[p.name][at: at + stop - start])
        return out

    def arrived(self, k: int, data: torch.Tensor | None, value: int | None,
                mac: BucketMac | None) -> None:
        """Bucket `k` is all here in `data` (from `buffer`), with its check
        value and tag if computed on the way: a scattered bucket's slots go
        to their places (None: its pieces landed there, `in_place`). Its
        value is required then: the bytes it covers are not kept as they
        came."""
        b = self.buckets[k]
        if b.scattered:
            if value is None:
                raise ValueError(f"bucket {b.index}: a scattered bucket needs its check value "
                                 "as it lands")
            if data is not None:
                land(self.places, b.params, data)
        b.checksum, b.mac, b.received = value, mac, True

    def give_back(self, k: int, buf: torch.Tensor) -> None:
        """Bucket `k` arrived and went on: its lent buffer is free."""
        if self.buckets[k].scattered:
            self.lent.give_back(buf)


@dataclass
class Staging:
    buckets: list[StagedBucket] = field(default_factory=list)
    _pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # Set when the TP workers of one host share one staged copy (host_share.py):
    # the leader's buffers are files there; a follower maps them at a load.
    shared: SharedBuffers | None = None
    # Pinned on a GPU server: its buffers are copied to the GPU at every load.
    pinned: bool = False
    places: Places = field(default_factory=Places)  # the scattered buckets' tensors
    lent: ReceiveBuffers = field(default_factory=ReceiveBuffers)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the push's

    def share(self, buffers: Callable[[str], SharedBuffers | None], kind: str) -> None:
        """Stage into the files of a shared copy (None: this worker's own)."""
        self.shared = buffers(kind)
        self.places.shared = buffers(f"{kind}-places")

    def allocate(self, manifest: list[BucketManifest], device: torch.device) -> None:
        """Lay out buffers for a manifest, reusing last push's where sizes
        match, and free the pooled buffers it does not use."""
        self.release()
        self.device = device
        pin = self.pinned and device.type == "cpu" and torch.cuda.is_available()
        scattered = [holds_chunk(b.params) for b in manifest]
        self.places.allocate({p.name: p.tensor_nbytes for b, s in zip(manifest, scattered,
                                                                      strict=True)
                              if s for p in b.params}, device, pin)
        if self.lent.reset(max((b.nbytes for b, s in zip(manifest, scattered, strict=True)
                                if s), default=0), device, pin) and pin:
            _release_cached_pinned()  # as for the pool below (module docstring)
        if self.shared is not None:
            return self._allocate_shared(manifest, scattered)
        pool, self._pool = self._pool, {}
        for b, s in zip(manifest, scattered, strict=True):
            pooled = pool.get(b.nbytes) if not s else None
            buf = pooled.pop() if pooled else None
            if s:
                buf = _UNMAPPED
            elif buf is None or buf.device != device:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self.buckets.append(StagedBucket(b.index, b.nbytes, b.params, buf, source=b.source,
                                             scattered=s))
        if any(pool.values()):  # what the layout does not use goes, pinned or not
            pool.clear()
            _release_cached_pinned()

    def _allocate_shared(self, manifest: list[BucketManifest], scattered: list[bool]) -> None:
        s = self.shared
        assert s is not None
        for b, spread in zip(manifest, scattered, strict=True):  # a follower maps at the load
            buf = s.buffer(b.index, b.nbytes) if s.leader and not spread else _UNMAPPED
            self.buckets.append(StagedBucket(b.index, b.nbytes, b.params, buf, source=b.source,
                                             scattered=spread))
        if s.leader:
            s.keep_only({b.index for b, spread in zip(manifest, scattered, strict=True)
                         if not spread})

    def attach(self) -> None:
        """A follower: map the leader's buffers of this layout, afresh."""
        if self.shared is not None and not self.shared.leader:
            for b in self.buckets:
                if not b.scattered:
                    b.buffer = self.shared.attach(b.index, b.nbytes)
            self.places.attach()

    def detach(self) -> None:
        """A follower: unmap them again (the leader may replace them)."""
        if self.shared is not None and not self.shared.leader:
            for b in self.buckets:
                b.buffer = _UNMAPPED
            self.shared.drop()
            self.places.detach()

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers held: the staged push's, its places and receive
        buffers, and the pool's (shared ones by their leader alone: a
        follower's maps are the same memory)."""
        held = self.places.held_bytes + self.lent.held_bytes
        if self.shared is not None:
            return held + (self.shared.nbytes if self.shared.leader else 0)
        return held + sum(b.buffer.numel() for b in self.buckets) + sum(
            t.numel() for ts in self._pool.values() for t in ts)

    def release(self) -> None:
        """Forget the staged push; its buffers go back to the pool (shared
        ones stay mapped by the leader, by bucket index; places stay, by
        name, for the next push's layout)."""
        if self.shared is not None:
            self.detach()
        else:
            for b in self.buckets:
                if not b.scattered:
                    self._pool.setdefault(b.nbytes, []).append(b.buffer)
        self.buckets = []

    def drop_pool(self) -> None:
        """Forget the buffers too: a receive may still write into them."""
        self.release()
        self._pool.clear()
        self.places.drop()
        self.lent = ReceiveBuffers()  # a stale receive may still lend from the old
        if self.shared is not None:
            self.shared.drop()
        _release_cached_pinned()

    # ----------------------------------------------------------------- arrival

    def receipt(self) -> Receipt:
        """This push's buckets, places and receive buffers, for its receive."""
        return Receipt(self.buckets, self.places.buffers, self.lent)

    def stage(self, k: int, data: torch.Tensor, check: Check, key: bytes | None = None
              ) -> None:
        """Bucket `k`'s bytes, handed over whole (HTTP, a test): copied in,
        checked (and tagged, with the connection's `key`) as they land."""
        b = self.buckets[k]
        if data.numel() != b.nbytes:
            raise ValueError(f"bucket {b.index}: {data.numel()} bytes, expected {b.nbytes}")
        if not b.scattered:
            b.buffer.copy_(data)
            data = b.buffer
        mac = BucketMac(key).update(data) if key is not None else None
        self.receipt().arrived(k, data, checksum(data, check), mac)

    def bucket_bytes(self, k: int) -> torch.Tensor:
        """Bucket `k` as staged, for a peer: its buffer, or read back from
        the places (placed_tensors.py)."""
        b = self.buckets[k]
        if not b.scattered:
            return b.buffer
        return self.places.read_back(b.params, torch.zeros(b.nbytes, dtype=torch.uint8))

    # ------------------------------------------------------------------- check

    def check(self, expected: list[int], check: Check = "crc32") -> None:
        """Every bucket arrived and matches the trainer's check value, or raise."""
        if len(expected) != len(self.buckets):
            raise ValueError(f"{len(expected)} checksums for {len(self.buckets)} buckets")
        for b, want in zip(self.buckets, expected, strict=True):
            if not b.received:
                raise ValueError(f"bucket {b.index} never arrived")
            if b.checksum is None:
                b.checksum = checksum(b.buffer, check)
            if b.checksum != want:
                names = ", ".join(p.name for p in b.params[:4])
                raise ValueError(
                    f"bucket {b.index} checksum mismatch ({check}: got {b.checksum:#010x}, "
                    f"trainer sent {want:#010x}); holds {names}"
                    f"{'...' if len(b.params) > 4 else ''}"
                )

    def check_macs(self, expected: list[str], key: bytes, connection_id: str,
                   version: int) -> None:
        """Every bucket's keyed tag matches the trainer's, or raise naming the
        first that does not: bytes nobody with the connection's secret sent."""
        if len(expected) != len(self.buckets):
            raise ValueError(f"{len(expected)} bucket tags (macs) for {len(self.buckets)} "
                             "buckets")
        for b, want in zip(self.buckets, expected, strict=True):
            if not b.received:
                raise ValueError(f"bucket {b.index} never arrived")
            if b.mac is None and b.scattered:
                raise ValueError(f"bucket {b.index} was not tagged as it landed")
            mac = b.mac if b.mac is not None else BucketMac(key).update(b.buffer)
            if not same_tag(mac.finish(connection_id, version, b.index, b.nbytes), want):
                raise ValueError(
                    f"bucket {b.index} failed authentication: its keyed BLAKE2b tag does not "
                    "match the trainer's (the bytes were altered on the way, or sent by "
                    "someone without this connection's secret)")

    # -------------------------------------------------------------------- load

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in manifest order, each once, each a view: into its
        bucket, or its place (where its first slot is in the manifest)."""
        placed: set[str] = set()
        for b in self.buckets:
            for p in b.params:
                if not b.scattered:
                    yield p.name, slot_tensor(b.buffer, p)
                elif p.name not in placed:
                    placed.add(p.name)
                    yield p.name, self.places.tensor(p)

    def flat_views(self) -> dict[str, torch.Tensor]:
        """Each tensor as staged, a typed flat view (a chunk's bucket is
        always scattered, so every tensor is in one piece)."""
        return {name: t.view(-1) for name, t in self.tensors()}


def _release_cached_pinned() -> None:
    """Return freed pinned blocks to the OS (module docstring): PyTorch's
    caching host allocator keeps them otherwise. Frees only blocks no tensor
    uses; a no-op without CUDA."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()
