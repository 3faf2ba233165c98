"""The process-wide registry of replica liveness, and each client's view of it.

Why process-wide: a rollout process holds many clients over the same
replicas (one per thread, per environment, per library). Keyed by replica URL,
N clients share one pinger thread per URL and one verdict, so the first
client to notice a frozen replica has noticed it for all, and the ping load
on a replica does not grow with the number of clients (see liveness.py).

Entries are counted: each client's `ClientLiveness` holds the URLs of its pool
(again after a DNS refresh) and releases them on close, or when the client is
garbage-collected unclosed (a weakref finalizer); the last release stops the
pinger.

The key is the URL, the policy and how a ping reaches the replica: clients
on httpx's default transport share one entry per URL; a client given its own
sync transport shares only with clients given the same transport object (a
URL may lead elsewhere through it); an async client given its own async
transport pings through its own event loop, so its entries are its own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import httpx

from rollout_sidecar.protocol.calls.liveness import LivenessPolicy, Ping, ReplicaLiveness
from rollout_sidecar.protocol.calls.tls import shared_tls

Key = tuple[str, LivenessPolicy, Hashable]


class LivenessRegistry:
    """Every `ReplicaLiveness` of the process, with how many views hold each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Key, tuple[ReplicaLiveness, int]] = {}

    def hold(self, key: Key, ping: Ping | None,
             transport: httpx.BaseTransport | None) -> ReplicaLiveness:
        """The entry for `key`, made (with `ping`, or a GET through
        `transport`, or httpx's default one) if nobody holds it yet."""
        with self._lock:
            entry, holders = self._entries.get(key, (None, 0))
            if entry is None:
                entry = _make(key[0], key[1], ping, transport)
            self._entries[key] = (entry, holders + 1)
            return entry

    def release(self, key: Key) -> None:
        with self._lock:
            entry, holders = self._entries.get(key, (None, 0))
            if entry is None:
                return
            if holders > 1:
                self._entries[key] = (entry, holders - 1)
                return
            del self._entries[key]
        entry.stop()

    def entries(self) -> list[ReplicaLiveness]:
        """Every live entry (for tests and debugging)."""
        with self._lock:
            return [e for e, _ in self._entries.values()]


def _make(url: str, policy: LivenessPolicy, ping: Ping | None,
          transport: httpx.BaseTransport | None) -> ReplicaLiveness:
    if ping is not None:
        return ReplicaLiveness(url, ping, policy)
    # /health is open (no token). A transport given by a client stays open:
    # closing our httpx.Client would close it under that client.
    http = httpx.Client(transport=transport, verify=shared_tls())

    def get(ping_url: str, timeout_s: float) -> None:
        http.get(ping_url, timeout=timeout_s)
    return ReplicaLiveness(url, get, policy, on_stop=http.close if transport is None else None)


REGISTRY = LivenessRegistry()


class ClientLiveness:
    """One client's hold on the shared verdicts of its pool's replicas.

    `transport`: the client's sync transport (None: httpx's default). `ping`:
    for a client whose requests only its own event loop can send (an async
    client with its own transport), the ping to use; not shared. The pool
    calls `track` with its URLs and asks `frozen(url)` at every pick."""

    def __init__(self, policy: LivenessPolicy, transport: httpx.BaseTransport | None = None,
                 ping: Ping | None = None, registry: LivenessRegistry = REGISTRY) -> None:
        self.policy = policy
        self._transport = transport
        self._ping = ping
        self._registry = registry
        self._how: Hashable = id(self) if ping is not None else transport
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Key, ReplicaLiveness]] = {}  # replaced whole, read freely
        self._closed = False

    def bind(self, owner: object) -> ClientLiveness:
        """Release everything when `owner` is garbage-collected unclosed."""
        weakref.finalize(owner, self.close)
        return self

    def track(self, urls: Iterable[str]) -> None:
        """Hold exactly `urls` (the pool's replicas), releasing the others."""
        urls = list(urls)
        with self._lock:
            if self._closed:
                return
            held = dict(self._held)
            for url in urls:
                if url not in held:
                    key: Key = (url, self.policy, self._how)
                    held[url] = (key, self._registry.hold(key, self._ping, self._transport))
            gone = [held.pop(u)[0] for u in list(held) if u not in urls]
            self._held = held
        for key in gone:
            self._registry.release(key)

    def get(self, url: str) -> ReplicaLiveness | None:
        held = self._held.get(url)
        return None if held is None else held[1]

    def frozen(self, url: str) -> str | None:
        """Why `url` is frozen, or None while it answers (or is not tracked)."""
        entry = self.get(url)
        return None if entry is None else entry.frozen

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held, self._held = self._held, {}
        for key, _ in held.values():
            self._registry.release(key)


def client_liveness(policy: LivenessPolicy | None, owner: Any,
                    transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None,
                    loop_ping: Ping | None = None) -> ClientLiveness | None:
    """The view a client holds: None without a policy (no shared liveness).
    An async client's own transport can only be driven from its event loop:
    given `loop_ping`, such a client pings through it, in entries of its own."""
    if policy is None:
        return None
    if transport is not None and loop_ping is not None:
        return ClientLiveness(policy, ping=loop_ping).bind(owner)
    sync = transport if isinstance(transport, httpx.BaseTransport) else None
    return ClientLiveness(policy, transport=sync).bind(owner)
