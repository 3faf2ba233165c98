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
buffers go host-to-device at every load. It comes from PyTorch's caching host
allocator (`pin_memory=True`), which rounds each block up to a power of two
and keeps freed blocks cached for reuse, never returning them
(c10/cuda/CUDACachingHostAllocator.cpp); so a pool buffer freed here is also
released from that cache (`_host_emptyCache`), and a delta's patches, applied
on the host and never copied to the GPU, are not pinned at all. The staged
copy's bucket sizes repeat from push to push, so its pool reallocates nothing.

A tensor larger than a bucket arrives split across buckets, and with every
trainer rank sending its own FSDP2 rows (trainer/gather/own_rows.py) every
sharded tensor arrives as one chunk per rank, in different buckets. At load
time a split tensor's chunks are copied into one new contiguous tensor: the
one copy a split costs the server. Unsplit tensors stay zero-copy views.
vLLM's layerwise reload keeps every tensor it was given until its layer is
processed, and reload.py defers all processing until `load_weights` has
returned (that is what makes the load all-or-nothing), so the copies of all
split tensors are alive together at the end of the load: the load's extra
peak is the sum of the split tensors' bytes (a 150k-vocabulary model with
buckets larger than its MLP weights: embedding + lm_head, 2 x 1.2 GB at
hidden 4096; a push of own rows: about the model's bytes), freed when the
load ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_check import checksum
from rollout_sidecar.protocol.data_plane.bucket_mac import BucketMac, same_tag
from rollout_sidecar.protocol.data_plane.wire_format import (
    slot_bytes,
    slot_tensor,
    torch_dtype,
)
from rollout_sidecar.protocol.schema import BucketManifest, Check, TensorSlot
from rollout_sidecar.server.weights.worker.host_share import SharedBuffers

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


@dataclass
class Staging:
    buckets: list[StagedBucket] = field(default_factory=list)
    _pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # Set when the TP workers of one host share one staged copy (host_share.py):
    # the leader's buffers are files there; a follower maps them at a load.
    shared: SharedBuffers | None = None
    # Pinned on a GPU server: its buffers are copied to the GPU at every load.
    pinned: bool = False

    def allocate(self, manifest: list[BucketManifest], device: torch.device) -> None:
        """Lay out buffers for a manifest, reusing last push's where sizes
        match, and free the pooled buffers it does not use."""
        self.release()
        if self.shared is not None:
            return self._allocate_shared(manifest)
        pool, self._pool = self._pool, {}
        pin = self.pinned and device.type == "cpu" and torch.cuda.is_available()
        for b in manifest:
            pooled = pool.get(b.nbytes)
            buf = pooled.pop() if pooled else None
            if buf is None or buf.device != device:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self.buckets.append(StagedBucket(b.index, b.nbytes, b.params, buf, source=b.source))
        if any(pool.values()):  # what the layout does not use goes, pinned or not
            pool.clear()
            _release_cached_pinned()

    def _allocate_shared(self, manifest: list[BucketManifest]) -> None:
        s = self.shared
        assert s is not None
        for b in manifest:  # a follower maps the leader's buffers at the load
            buf = s.buffer(b.index, b.nbytes) if s.leader else _UNMAPPED
            self.buckets.append(StagedBucket(b.index, b.nbytes, b.params, buf, source=b.source))
        if s.leader:
            s.keep_only({b.index for b in manifest})

    def attach(self) -> None:
        """A follower: map the leader's buffers of this layout, afresh."""
        if self.shared is not None and not self.shared.leader:
            for b in self.buckets:
                b.buffer = self.shared.attach(b.index, b.nbytes)

    def detach(self) -> None:
        """A follower: unmap them again (the leader may replace them)."""
        if self.shared is not None and not self.shared.leader:
            for b in self.buckets:
                b.buffer = _UNMAPPED
            self.shared.drop()

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers held: the staged push's and the pool's (shared
        ones by their leader alone: a follower's maps are the same memory)."""
        if self.shared is not None:
            return self.shared.nbytes if self.shared.leader else 0
        return sum(b.nbytes for b in self.buckets) + sum(
            t.numel() for ts in self._pool.values() for t in ts)

    def release(self) -> None:
        """Forget the staged push; its buffers go back to the pool (shared
        ones stay mapped by the leader, by bucket index)."""
        if self.shared is not None:
            self.detach()
        else:
            for b in self.buckets:
                self._pool.setdefault(b.nbytes, []).append(b.buffer)
        self.buckets = []

    def drop_pool(self) -> None:
        """Forget the buffers too: a receive may still write into them."""
        self.release()
        self._pool.clear()
        if self.shared is not None:
            self.shared.drop()
        _release_cached_pinned()

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
            mac = b.mac if b.mac is not None else BucketMac(key).update(b.buffer)
            if not same_tag(mac.finish(connection_id, version, b.index, b.nbytes), want):
                raise ValueError(
                    f"bucket {b.index} failed authentication: its keyed BLAKE2b tag does not "
                    "match the trainer's (the bytes were altered on the way, or sent by "
                    "someone without this connection's secret)")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in manifest order: views into the staged buffers, but
        a split tensor reassembled into a new one, yielded where its last
        chunk lands (its chunks cover it exactly once, in any order and
        anywhere in the manifest: manifest_check.py)."""
        whole: dict[str, tuple[torch.Tensor, int]] = {}  # split tensors: bytes so far
        for b in self.buckets:
            for p in b.params:
                start = p.chunk_offset
                if start is None:
                    yield p.name, slot_tensor(b.buffer, p)
                    continue
                buf, covered = whole.get(p.name) or (torch.empty(
                    p.tensor_nbytes, dtype=torch.uint8, device=b.buffer.device), 0)
                buf[start: start + p.length].copy_(slot_bytes(b.buffer, p))
                covered += p.length
                if covered < p.tensor_nbytes:
                    whole[p.name] = (buf, covered)
                    continue
                whole.pop(p.name, None)
                yield p.name, buf.view(torch_dtype(p.dtype)).view(p.shape)
        if whole:  # manifest_check.py refuses such a manifest
            raise ValueError(f"{next(iter(whole))}: chunks do not cover the tensor")


def _release_cached_pinned() -> None:
    """Return freed pinned blocks to the OS (module docstring): PyTorch's
    caching host allocator keeps them otherwise. Frees only blocks no tensor
    uses; a no-op without CUDA."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()
