"""A bucket's integrity check, computed where its bytes are.

Two checks, named on the wire (`BeginRequest.check`), so a server knows which
one a trainer speaks and both compute the same value:

- `crc32`: CRC-32 (zlib's polynomial) of the bytes, on the host. Every
  trainer speaks it; a trainer from before `check` existed means it. Computed
  with ISA-L (the `isal` package: 8.3 GiB/s here against zlib's 2.0, the same
  values, the GIL released), zlib where isal is missing.
- `sum64`: two position-weighted sums over the bytes read as little-endian
  int16 words, computed by torch on whatever device holds the bucket, so an
  NCCL bucket is checked in GPU memory on both sides and never copied to the
  host for it (a CRC-32 on the GPU is no torch op; this is two reductions).
  Offered by a server (`check:sum64` in `WeightStatus.capabilities`) and used
  by a trainer whose buckets live on a GPU.

What each catches. CRC-32 catches every burst of up to 32 flipped bits. sum64:
A = sum of the words, B = sum of word i times (i mod 65521) + 1, each kept mod
2^32: any change inside one word changes A (a word moves by less than 2^16);
two words swapped at different positions mod 65521 change B; stale bytes
where a bucket never arrived change both but with odds 2^-64 against. Neither
is a defence against someone who can write the wire: the keyed BLAKE2b tags
(bucket_mac.py) are, when the connection authenticates buckets.

Exact on every device: within one chunk each product fits int32
(|word| <= 2^15, weight <= 65521 < 2^16: |product| < 2^31) and each chunk's
sums fit int64 (2^24 words of < 2^31), so integer reductions give the same
value on CPU and GPU whatever their order.
"""

from __future__ import annotations

import functools
import zlib

import torch

from rollout_sidecar.protocol.schema import Check

try:  # ISA-L: 4x zlib's CRC-32 here, the same values
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    _crc32 = zlib.crc32


MODULUS = 65521  # the weights' period: the largest prime below 2^16 (Adler's)
CHUNK_WORDS = MODULUS * 128  # 16 MiB of bytes per reduction; every chunk starts a period
_MASK = (1 << 32) - 1


def crc32(buf: torch.Tensor, running: int = 0) -> int:
    """CRC-32 of a contiguous uint8 tensor (copied to the host if it is not
    there); `running`: the CRC of the bytes before it."""
    return _crc32(memoryview((buf if buf.is_cpu else buf.cpu()).numpy()), running)


def crc32_of_bytes(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 of bytes already on the host (an HTTP body)."""
    return _crc32(data)


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    return (torch.arange(CHUNK_WORDS, dtype=torch.int32, device=device) % MODULUS) + 1


def sum64(buf: torch.Tensor) -> int:
    """The `sum64` check of a contiguous uint8 tensor, on its own device
    (module docstring): `(A mod 2^32) << 32 | (B mod 2^32)`. An odd last
    byte counts as one more word, zero-extended."""
    n = buf.numel()
    words = buf[: n - n % 2].view(torch.int16)
    weights = _weights(buf.device)
    a = b = 0
    sums = []
    for start in range(0, words.numel(), CHUNK_WORDS):
        w = words[start: start + CHUNK_WORDS]
        sums.append(torch.sum(w, dtype=torch.int64))
        sums.append(torch.sum(torch.mul(w, weights[: w.numel()]), dtype=torch.int64))
    if sums:  # one transfer of every chunk's two sums
        values = torch.stack(sums).tolist()
        a, b = sum(values[0::2]), sum(values[1::2])
    if n % 2:
        last = int(buf[n - 1].item())
        a += last
        b += last * ((n // 2) % MODULUS + 1)
    return ((a & _MASK) << 32) | (b & _MASK)


def checksum(buf: torch.Tensor, check: Check) -> int:
    """`buf`'s value under `check`: sum64 where the bytes are, crc32 on the host."""
    return sum64(buf) if check == "sum64" else crc32(buf)


def preferred_check(on_device: bool, offered: bool) -> Check:
    """A trainer's check: sum64 for buckets in GPU memory where every replica
    takes it, else crc32 (host buckets: ISA-L's CRC-32 is faster on the host)."""
    return "sum64" if on_device and offered else "crc32"
