"""The data plane's rendezvous store, signed with the connection's secret.

Every rank of a data-plane group meets through one server's TCPStore, which
anyone who reaches its port can read and write. Unsigned, a process that
overwrote a rank's address made every other rank parse garbage (gloo:
"std::bad_alloc") or wait out the whole timeout. Here each value a rank sets
is prefixed with a keyed BLAKE2b over key and value, and every value read is
checked: one that fails names the key and the store, and the rank writes a
signed abort marker, so the other ranks stop waiting within a poll instead of
a timeout. The trainer then retries under a new connection id and secret.

Counters (`add`) are the store's own arithmetic and cannot be signed; gloo's
and NCCL's rendezvous use set/get/wait only. Every rank deletes the keys it
wrote once the group formed (after a barrier: no rank still needs them), so
keys do not pile up across connections.

What this does not do: hide anything (anyone on the port still sees the key
names, never the secret), or stop someone who can reach the port from
deleting keys (a rendezvous then times out: denial of service is the
NetworkPolicy's job).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import time
from typing import Any

import torch.distributed as dist

from rollout_sidecar.protocol.data_plane.bucket_mac import store_hasher

TAMPERED = "data-plane rendezvous tampered with"
ABORT_KEY = "abort"  # under the connection's prefix, signed like the rest
POLL_S = 0.05
_TAG = 32
_ABSENT = b"\0absent"  # shorter than a tag: no signed value equals it


class RendezvousAborted(RuntimeError):
    """A rank (or the trainer, giving up a connect) wrote the abort marker."""


class RendezvousTampered(RendezvousAborted):
    """A value in the rendezvous store was not written by this connection."""


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """A store for one rank of one connection (wraps its PrefixStore)."""

    def __init__(self, inner: Any, secret: bytes, where: str, timeout_s: float) -> None:
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._where = where  # host:port, for the error
        self._timeout_s = timeout_s
        self.written: set[str] = set()

    def __repr__(self) -> str:  # never the secret
        return f"SignedStore({self._where})"

    # ----------------------------------------------------------- signing

    def _tag(self, key: str, value: bytes) -> bytes:
        h = store_hasher(self._secret)
        k = key.encode()
        h.update(len(k).to_bytes(8, "little") + k + value)
        return h.digest()

    def _sign(self, key: str, value: bytes) -> bytes:
        return self._tag(key, value) + value

    def _open(self, key: str, raw: bytes) -> bytes:
        tag, value = raw[:_TAG], raw[_TAG:]
        if len(raw) < _TAG or not hmac.compare_digest(tag, self._tag(key, value)):
            message = (f"{TAMPERED}: key {key!r} at {self._where} was not written by this "
                       "connection (someone else can reach the data-plane port)")
            self.abort(message)
            raise RendezvousTampered(message)
        return value

    def abort(self, reason: str) -> None:
        """Tell the other ranks to stop waiting (best effort). Not in
        `written`: it must outlive this rank's clean-up, so the trainer
        deletes it once every rank gave up (`delete_connection_keys`). The
        first marker stays: a later one (a trainer giving up because a rank
        aborted) must not hide why the first rank did."""
        with contextlib.suppress(Exception):
            self._inner.compare_set(ABORT_KEY, b"", self._sign(ABORT_KEY, reason.encode()))

    # ------------------------------------------------------ Store methods

    def set(self, key: str, value: Any) -> None:
        self.written.add(key)
        self._inner.set(key, self._sign(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            self.wait([key], datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
            raw = self._read(key)
            if raw is not None:
                return self._open(key, raw)
            # Deleted since the wait saw it: a rank that failed deletes what it
            # wrote once its abort marker is set, which the next wait reports.
            time.sleep(POLL_S)

    def _read(self, key: str) -> bytes | None:
        """The key's value, or None if it is not there, without blocking: the
        store's own get waits for a missing key for its whole timeout, which
        a key deleted between our check and the get cost every other rank
        (10 s for a server's rank in a tampered connect, `join_s` for the
        trainer's). A compare-and-set whose expected value no signed value can
        equal reads without writing."""
        got = _bytes(self._inner.compare_set(key, _ABSENT, _ABSENT))
        return None if got == _ABSENT else got

    def add(self, key: str, amount: int) -> int:
        self.written.add(key)
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        # Tags are deterministic, so the signed form of `expected` is known.
        exp = _bytes(expected)
        self.written.add(key)
        got = self._inner.compare_set(key, self._sign(key, exp) if exp else b"",
                                      self._sign(key, _bytes(desired)))
        return self._open(key, _bytes(got))

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        """Poll, so an abort marker from another rank ends the wait at once."""
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline = time.monotonic() + limit
        while not self._inner.check(list(keys)):
            marker = self._read(ABORT_KEY)
            if marker is not None:
                why = self._open(ABORT_KEY, marker).decode()
                kind = RendezvousTampered if TAMPERED in why else RendezvousAborted
                raise kind(f"rendezvous aborted by another rank: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"data-plane rendezvous at {self._where}: keys {keys} not "
                                   f"written within {limit:.0f}s (a rank never joined)")
            time.sleep(POLL_S)

    def delete_key(self, key: str) -> bool:
        self.written.discard(key)
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self._timeout_s = timeout.total_seconds()

    # --------------------------------------------------------- clean up

    def delete_written(self) -> None:
        """Delete every key this rank wrote (best effort: the store may be gone)."""
        for key in list(self.written):
            with contextlib.suppress(Exception):
                self._inner.delete_key(key)
        self.written.clear()


def delete_connection_keys(store: Any, connection_id: str) -> int:
    """Delete whatever is left under a connection's prefix (its abort marker,
    a rogue's writes) after a failed rendezvous, once no rank waits on it.
    Needs `list_keys` (torch >= 2.8's TCPStore); returns how many went."""
    prefix = group_prefix(connection_id)
    if not hasattr(store, "list_keys"):
        return 0
    gone = 0
    with contextlib.suppress(Exception):
        for key in store.list_keys():
            if key.startswith(prefix):
                gone += bool(store.delete_key(key))
    return gone


def abort_connection(store: Any, connection_id: str, secret: bytes, where: str,
                     reason: str) -> None:
    """Write a connection's signed abort marker from outside its ranks: a
    trainer whose connect failed (a replica refused it) ends its own join, and
    any replica's, within a poll rather than at the join's timeout."""
    SignedStore(dist.PrefixStore(group_prefix(connection_id), store), secret, where,
                timeout_s=0).abort(reason)


def group_prefix(connection_id: str) -> str:
    return f"rs/{connection_id}/"
