"""Host-side staging of one push: per-bucket buffers, checksums, views.

Buckets land here and are verified while the old weights keep serving. Only a
complete, verified set is ever loaded into the model, which is what makes a
commit atomic. Buffers are kept for the next push of the same layout, so a
steady-state push allocates nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def crc32(buf: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor (zlib releases the GIL)."""
    return zlib.crc32(memoryview(buf.numpy()))


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class StagedBucket:
    index: int
    nbytes: int
    params: list[dict]  # {"name", "dtype", "shape", "offset"}
    buffer: torch.Tensor
    received: bool = False
    checksum: int | None = None  # computed on arrival


@dataclass
class Staging:
    buckets: list[StagedBucket] = field(default_factory=list)
    _pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def prepare(self, manifest: list[dict], device: torch.device) -> None:
        """Lay out buffers for a manifest, reusing last push's where sizes match."""
        self.release()
        for b in manifest:
            pooled = self._pool.get(b["nbytes"])
            buf = pooled.pop() if pooled else None
            if buf is None or buf.device != device:
                # Pinned on a GPU server: host-to-device copies at load run at full speed.
                pin = device.type == "cpu" and torch.cuda.is_available()
                buf = torch.empty(b["nbytes"], dtype=torch.uint8, device=device, pin_memory=pin)
            self.buckets.append(StagedBucket(b["index"], b["nbytes"], b["params"], buf))

    def release(self) -> None:
        """Forget the staged push; its buffers go back to the pool."""
        for b in self.buckets:
            self._pool.setdefault(b.nbytes, []).append(b.buffer)
        self.buckets = []

    def drop_pool(self) -> None:
        self.release()
        self._pool.clear()

    def verify(self, expected: list[int]) -> None:
        """Every bucket arrived and matches the trainer's checksum, or raise."""
        if len(expected) != len(self.buckets):
            raise ValueError(f"{len(expected)} checksums for {len(self.buckets)} buckets")
        for b, want in zip(self.buckets, expected, strict=True):
            if not b.received:
                raise ValueError(f"bucket {b.index} never arrived")
            if b.checksum is None:
                b.checksum = crc32(b.buffer) if b.buffer.is_cpu else crc32(b.buffer.cpu())
            if b.checksum != want:
                names = ", ".join(p["name"] for p in b.params[:4])
                raise ValueError(
                    f"bucket {b.index} checksum mismatch (got {b.checksum:#010x}, trainer sent "
                    f"{want:#010x}); holds {names}{'...' if len(b.params) > 4 else ''}"
                )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the staged buffers, no copies."""
        for b in self.buckets:
            for p in b.params:
                dtype = torch_dtype(p["dtype"])
                numel = 1
                for d in p["shape"]:
                    numel *= d
                nbytes = numel * dtype.itemsize
                raw = b.buffer[p["offset"]: p["offset"] + nbytes]
                yield p["name"], raw.view(dtype).view(p["shape"])
