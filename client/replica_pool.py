"""The replica pool: which server replica each request goes to.

One rule, applied per request under a lock (the sync client is shared by
threads; the async one by tasks of one loop, for which the lock is free):

1. only replicas that are up (not marked down by a failure, see `mark_down`,
   nor found frozen by the process-wide liveness ping, see liveness.py)
   and not excluded for this request;
2. with `min_weight_version`: only those known to hold it; if none is known
   to, those with the highest known version (a push usually reaches every
   replica, and the server waits, bounded, for a version it is about to get
   and refuses at once one that no push in flight brings). Before such a
   request the plan asks the replicas of unknown version (`claim_version_check`),
   so a fresh client does not first try a replica restarted at v0;
3. with a `session_key`: its rendezvous-hash replica, if rule 1-2 allow it,
   so the turns of one episode reuse that replica's prefix cache;
4. else the replica with the fewest requests outstanding from this client,
   ties taken in turn.

Outstanding counts are this client's own, not the server's queue: cheap, and
with several client processes each still spreads its own load.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollout_sidecar.client.liveness_registry import ClientLiveness
from rollout_sidecar.protocol.schema.endpoints import DNS_PREFIX, expand_urls, url_items

# A forced re-resolution (every replica down) at most this often: many
# requests find the pool down at once, one lookup serves them all.
MIN_FORCED_REFRESH_S = 1.0
# A replica's version is asked (GET /info) at most this often: concurrent
# requests of a fresh client share one ping per replica.
VERSION_CHECK_EVERY_S = 5.0


@dataclass
class Replica:
    url: str
    outstanding: int = 0
    weight_version: int | None = None  # last seen; None before any answer
    down_until: float = 0.0  # on the pool's clock
    last_error: str | None = None
    version_checked_at: float = float("-inf")


@dataclass(frozen=True)
class ReplicaState:
    """A snapshot of one replica, for logging (`client.replicas()`)."""

    url: str
    outstanding: int
    weight_version: int | None
    down_for_s: float  # 0 when up
    last_error: str | None
    frozen: bool = False  # the process's liveness ping gets no answer: skipped until it does


class ReplicaPool:
    """The replicas behind one client, and the choice among them.

    `urls`: anything `expand_urls` takes. A `dns+` name is re-resolved every
    `refresh_s` and when every replica is down; the caller does the lookup
    (`claim_refresh` then `refresh`) so the async client can run it off the
    event loop. `liveness`: the client's hold on the process-wide verdicts
    (None: none); the pool keeps it holding exactly its replicas.
    """

    def __init__(self, urls: str | Sequence[str] | None, refresh_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 liveness: ClientLiveness | None = None) -> None:
        # Read $ROLLOUT_SIDECAR_URL once: a refresh re-resolves the same names.
        self._items = url_items(urls)
        self.uses_dns = any(u.startswith(DNS_PREFIX) for u in self._items)
        self.refresh_s = refresh_s
        self.clock = clock
        self._lock = threading.Lock()
        self._replicas = {u: Replica(u) for u in expand_urls(self._items)}
        self._resolved_at = clock()
        self._turn = 0
        self.liveness = liveness
        if liveness is not None:
            liveness.track(self._replicas)

    # ------------------------------------------------------------------ choice

    def pick(self, *, min_version: int | None = None, session_key: str | None = None,
             exclude: frozenset[str] | set[str] = frozenset(),
             tried: frozenset[str] | set[str] = frozenset()) -> str | None:
        """Choose a replica and count a request outstanding on it (`done`
        ends it). `tried` are avoided while another is up; `exclude` always.
        None: every candidate is down (see `wait_s`)."""
        with self._lock:
            now = self.clock()
            up = [r for r in self._replicas.values()
                  if r.url not in exclude and self._up(r, now)]
            if not up:
                return None
            # Version first: a retry goes to another holder of the version if
            # there is one, not to a replica known to be behind.
            holding = _holding(up, min_version)
            eligible = [r for r in holding if r.url not in tried] or holding
            chosen = self._session_replica(session_key, eligible) or self._least_loaded(eligible)
            chosen.outstanding += 1
            return chosen.url

    def _up(self, r: Replica, now: float) -> bool:
        return r.down_until <= now and (self.liveness is None
                                        or self.liveness.frozen(r.url) is None)

    def _session_replica(self, key: str | None, eligible: list[Replica]) -> Replica | None:
        # Rendezvous hashing over every replica, up or not: the key's replica
        # changes only when that replica leaves the list, and a replica that
        # is down or behind gives its keys back once it is fine again.
        if key is None:
            return None
        home = max(self._replicas, key=lambda url: _weight(key, url))
        return next((r for r in eligible if r.url == home), None)

    def _least_loaded(self, eligible: list[Replica]) -> Replica:
        fewest = min(r.outstanding for r in eligible)
        ties = [r for r in eligible if r.outstanding == fewest]
        self._turn += 1
        return ties[self._turn % len(ties)]

    # ------------------------------------------------------------- what we saw

    def done(self, url: str) -> None:
        """A request picked on `url` has ended (in any way)."""
        with self._lock:
            if (r := self._replicas.get(url)) is not None:
                r.outstanding = max(0, r.outstanding - 1)

    def saw_version(self, url: str, version: int | None) -> None:
        """`url` answered with `version`. Versions only grow, except when the
        server restarted on its checkpoint, so the latest answer wins. None:
        unknown again (it refused a version we thought it held)."""
        with self._lock:
            if (r := self._replicas.get(url)) is not None:
                r.weight_version = version

    def mark_down(self, url: str, for_s: float, error: str) -> None:
        """Skip `url` for `for_s` seconds (a failure, or its Retry-After)."""
        with self._lock:
            if (r := self._replicas.get(url)) is not None:
                r.down_until = max(r.down_until, self.clock() + for_s)
                r.last_error = error

    def mark_up(self, url: str) -> None:
        """`url` answered /ready: no longer skipped."""
        with self._lock:
            if (r := self._replicas.get(url)) is not None:
                r.down_until = 0.0

    def claim_version_check(self, min_version: int) -> list[str]:
        """The replicas whose version a request for `min_version` should ask
        first: none if an up replica is known to hold it, else every up one
        whose version is unknown (a fresh client, or one that refused) and
        not asked within `VERSION_CHECK_EVERY_S`. Claiming marks them asked."""
        with self._lock:
            now = self.clock()
            up = [r for r in self._replicas.values() if self._up(r, now)]
            if any(r.weight_version is not None and r.weight_version >= min_version for r in up):
                return []
            ask = [r for r in up if r.weight_version is None
                   and now - r.version_checked_at >= VERSION_CHECK_EVERY_S]
            for r in ask:
                r.version_checked_at = now
            return [r.url for r in ask]

    def wait_s(self, exclude: frozenset[str] | set[str] = frozenset()) -> float:
        """Seconds until the first replica not in `exclude` is up again (a
        frozen one: until it is pinged again)."""
        frozen = self.frozen_urls()
        recheck = self.liveness.policy.every_s if self.liveness is not None else 0.0
        with self._lock:
            now = self.clock()
            ups = [max(r.down_until, now + recheck) if r.url in frozen else r.down_until
                   for r in self._replicas.values() if r.url not in exclude]
            return max(0.0, min(ups, default=now) - now)

    def frozen_urls(self) -> dict[str, str]:
        """The replicas the process's liveness ping finds frozen, and why."""
        if self.liveness is None:
            return {}
        return {u: why for u in self.urls() if (why := self.liveness.frozen(u)) is not None}

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def snapshot(self) -> list[ReplicaState]:
        """Every replica's state now, in list order."""
        with self._lock:
            now = self.clock()
            return [ReplicaState(r.url, r.outstanding, r.weight_version,
                                 max(0.0, r.down_until - now), *self._error(r))
                    for r in self._replicas.values()]

    def _error(self, r: Replica) -> tuple[str | None, bool]:
        why = self.liveness.frozen(r.url) if self.liveness is not None else None
        return (r.last_error, False) if why is None else (f"frozen: {why}", True)

    # -------------------------------------------------------------------- DNS

    def claim_refresh(self, force: bool = False) -> bool:
        """True if the caller should call `refresh` now: a `dns+` pool whose
        lookup is older than `refresh_s` (or, with `force`, than a second).
        Claiming restarts the clock, so concurrent callers do not all resolve."""
        if not self.uses_dns:
            return False
        with self._lock:
            age = self.clock() - self._resolved_at
            if age < (MIN_FORCED_REFRESH_S if force else self.refresh_s):
                return False
            self._resolved_at = self.clock()
            return True

    def refresh(self) -> None:
        """Resolve the URLs again (blocking DNS; not under the lock). Known
        replicas keep their state; a failed lookup keeps the current list."""
        try:
            urls = expand_urls(self._items)
        except ValueError:
            return  # DNS trouble: the replicas we know are the best guess
        with self._lock:
            self._replicas = {u: self._replicas.get(u) or Replica(u) for u in urls}
        if self.liveness is not None:
            self.liveness.track(self.urls())


def _holding(replicas: list[Replica], min_version: int | None) -> list[Replica]:
    """The replicas rule 2 allows (see the module docstring)."""
    if min_version is None:
        return replicas
    known = [r for r in replicas if r.weight_version is not None
             and r.weight_version >= min_version]
    if known:
        return known
    best = max(_version(r) for r in replicas)
    return [r for r in replicas if _version(r) == best]


def _version(r: Replica) -> int:
    return -1 if r.weight_version is None else r.weight_version


def _weight(key: str, url: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
