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

Each check is one `BucketCheck` in `CHECKS`, asked by the senders and the
receivers what they need (is it computed where the bytes are, or on the
host? can it run piece by piece as a bucket arrives?) instead of comparing
names; a new check is a row there and its name in the wire's `Check`.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class BucketCheck:
    name: Check
    # Computed where the bytes are, device memory included; otherwise on the
    # host, so a bucket in device memory needs a host copy to be checked.
    on_device: bool
    compute: Callable[[torch.Tensor], int]  # the value of a whole bucket
    # The value carried over pieces as they arrive (`(piece, value so far)`);
    # None: only a whole bucket's, once it arrived.
    running: Callable[[torch.Tensor, int], int] | None = None

    def needs_host_copy(self, tagged: bool) -> bool:
        """A device bucket's bytes must come to the host: for this check, or
        for the keyed tag (`tagged`: bucket_mac.py hashes on the host)."""
        return not self.on_device or tagged


CHECKS: dict[str, BucketCheck] = {c.name: c for c in (
    BucketCheck("crc32", on_device=False, compute=crc32, running=crc32),
    BucketCheck("sum64", on_device=True, compute=sum64),
)}
DEFAULT_CHECK = CHECKS["crc32"]  # every trainer speaks it (and one that names none means it)


def bucket_check(name: str) -> BucketCheck:
    """The check of this name; a ValueError names the known ones."""
    try:
        return CHECKS[name]
    except KeyError:
        raise ValueError(f"check must be one of {sorted(CHECKS)}, not {name!r}") from None


def checksum(buf: torch.Tensor, check: Check) -> int:
    """`buf`'s value under `check`, computed where its check computes."""
    return bucket_check(check).compute(buf)


def preferred_check(on_device: bool, offered: bool) -> Check:
    """A trainer's check: one computed in device memory for buckets there,
    where every replica takes it; else the default (host buckets: ISA-L's
    CRC-32 is faster on the host than sum64 there)."""
    device = next(c for c in CHECKS.values() if c.on_device)
    return device.name if on_device and offered else DEFAULT_CHECK.name
