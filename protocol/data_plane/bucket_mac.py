"""Keyed BLAKE2b of each bucket: the data plane's proof that the bytes came
from the trainer that holds this connection's secret.

The trainer draws a fresh 32-byte secret per data-plane connection and hands
it to every replica over the admin-authenticated control plane
(`POST /weights/connect`). CRC-32 catches accidents; this catches forgery:
someone who can reach the data-plane port but never saw the secret cannot
produce a bucket that passes. The tag binds the bytes to the connection, the
push (its version: a connection pushes each version at most once, because a
failed push drops the connection and the next one draws a new secret) and
the bucket's index and length, so a bucket cannot be replayed into another
slot or another push.

The binding goes in after the bytes, so a receiver can hash each piece as it
lands (in a chain, while the next one arrives) and bind it at the check,
when the version is known. hashlib releases the GIL on large buffers, so the
hash runs beside the transfer, like the CRC.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import torch

SECRET_BYTES = 32
DIGEST_BYTES = 16  # 128-bit tags: forgery odds 2^-128 per try
_BUCKET = b"rs-bucket-v1"  # BLAKE2b personalisation: bucket tags only
_STORE = b"rs-store-v1"  # ... and rendezvous values only (signed_store.py)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(hex_secret: str) -> bytes:
    """The wire form (hex) back to bytes; a ValueError never quotes it."""
    try:
        key = bytes.fromhex(hex_secret)
    except ValueError:
        raise ValueError("data-plane secret: not hex") from None
    if not 16 <= len(key) <= 64:  # BLAKE2b takes keys up to 64 bytes
        raise ValueError(f"data-plane secret: {len(key)} bytes, expected 16 to 64")
    return key


def store_hasher(key: bytes) -> hashlib.blake2b:
    return hashlib.blake2b(key=key, digest_size=32, person=_STORE)


class BucketMac:
    """The running tag of one bucket: `update` with its bytes, in order (the
    whole bucket or its pieces), then `finish` with where it belongs."""

    def __init__(self, key: bytes) -> None:
        self._h = hashlib.blake2b(key=key, digest_size=DIGEST_BYTES, person=_BUCKET)

    def update(self, buf: torch.Tensor) -> BucketMac:
        """A contiguous uint8 tensor (a GPU one is copied to the host, as for
        the CRC)."""
        self._h.update(memoryview((buf if buf.is_cpu else buf.cpu()).numpy()))
        return self

    def finish(self, connection_id: str, version: int, index: int, nbytes: int) -> str:
        h = self._h.copy()  # finishing twice gives the same tag
        binding = f"{connection_id}\0{version}\0{index}\0{nbytes}".encode()
        h.update(binding)
        h.update(len(binding).to_bytes(8, "little"))  # the bytes/binding split is unambiguous
        return h.hexdigest()


def bucket_mac(key: bytes, buf: torch.Tensor, connection_id: str, version: int,
               index: int) -> str:
    return BucketMac(key).update(buf).finish(connection_id, version, index, buf.numel())


def same_tag(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class PushMacs:
    """Rank 0's tags of one push, in bucket order, for `POST /weights/prepare`."""

    def __init__(self, key: bytes, connection_id: str, version: int) -> None:
        self._key = key
        self.connection_id = connection_id
        self.version = version
        self.tags: list[str] = []

    def add(self, index: int, buf: torch.Tensor) -> None:
        self.tags.append(bucket_mac(self._key, buf, self.connection_id, self.version, index))

    def __repr__(self) -> str:  # never the key
        return f"PushMacs({self.connection_id}, v{self.version}, {len(self.tags)} tags)"
