"""One replica's liveness verdict, shared by every client in the process.

Why a ping, and why shared. A frozen replica (SIGSTOPped, a hung node)
accepts connections and never answers, and a non-streamed /generate sends no
byte until it is done, so silence on a request cannot tell frozen from busy
(see stall_watch.py). Each client used to find a frozen replica out alone,
one request at a time, after `stall_timeout_s` (30 s): a rollout fleet of
many processes, each with many clients, kept sending to it for a minute. Here
one pinger thread per replica URL per process asks GET /health (answered by
the server's HTTP process alone, never queued behind generation; it needs no
token) every `every_s`, bounded by `timeout_s`; `misses` unanswered in a row
make the replica frozen for every client of the process at once: none picks
it, and each request waiting on it is given up and retried elsewhere. Its
first answer makes it live again.

Why not hedging (a second copy after a multiple of recent latency): latency
varies a hundredfold with prompt and output length, so a hedge would send
long generations again, starting them over (maybe on newer weights) and
doubling the load of a replica that is merely slow, while a frozen replica
that gets no request would never be noticed. A liveness ping separates
frozen from busy whatever a generation's length: a busy replica answers it
and keeps every request, however long.

Cost: a replica is pinged only while a request to it has waited `after_s`
(or while it is frozen, to see it come back), so short requests and idle
clients send no ping at all, and a busy process sends one small GET per
replica per `every_s`, whatever its number of clients.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from rollout_sidecar.protocol.schema import routes

log = logging.getLogger(__name__)

# ping(url, timeout_s): returns if the replica answered anything; raises an
# httpx.TransportError if it did not (a refused connection, or any other
# exception: no verdict; see `refused`).
Ping = Callable[[str, float], None]


def refused(error: BaseException) -> bool:
    """Whether `error` is a refused connection: the replica's host answered
    that nothing listens there. Not silence: a draining server (SIGTERM) has
    closed its listener and still finishes the requests it holds on open
    connections, and a dead one resets them, so those requests end on their
    own either way. A frozen replica's kernel still accepts connections, so it
    shows as a timeout, which is what counts as a miss here and in
    stall_watch.py."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return True
        e = e.__cause__ or e.__context__
    return isinstance(error, httpx.ConnectError) and "connection refused" in str(error).lower()


@dataclass(frozen=True)
class LivenessPolicy:
    """How the shared pinger decides a replica is frozen.

    With the defaults a replica frozen under a waiting request is given up
    within about 7 s (`after_s`, up to `every_s` to the next tick, then
    `misses` x `timeout_s`). Two misses, not one: a 2 s bound is short, and a
    false verdict costs the replica's in-flight generations."""

    every_s: float = 2.0  # at most one GET /health per replica this often
    timeout_s: float = 2.0  # each ping's bound
    misses: int = 2  # unanswered in a row: frozen
    after_s: float = 1.0  # ping only once a request to it has waited this long


class Waiter:
    """A request waiting on a replica. `wake()` is called once, from the
    pinger's thread, if the replica is found frozen; `cause` then says why."""

    def __init__(self, entry: ReplicaLiveness, wake: Callable[[], None]) -> None:
        self.started = time.monotonic()
        self.wake = wake
        self.cause: httpx.TransportError | None = None
        self.verdict: str | None = None
        self._entry = entry

    def close(self) -> None:
        """The request ended: no longer watched."""
        self._entry._forget(self)


class ReplicaLiveness:
    """One replica's verdict (`frozen`: why, or None while it answers) and
    the daemon thread that pings it. Made and stopped by the registry
    (liveness_registry.py) as clients hold and release it."""

    def __init__(self, url: str, ping: Ping, policy: LivenessPolicy,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.url = url
        self.policy = policy
        self.frozen: str | None = None
        self.pings = 0  # sent so far (tests, logs)
        self._ping = ping
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._waiters: set[Waiter] = set()
        self._misses = 0
        self._last_error: httpx.TransportError | None = None
        self._last_ping = float("-inf")
        self._stopped = False
        self._kick = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"rollout-sidecar-liveness {url}")
        self._thread.start()

    # ----------------------------------------------------------- requests

    def wait(self, wake: Callable[[], None]) -> Waiter:
        """Watch one request to this replica until `Waiter.close`. Already
        frozen (it was picked just before the verdict): woken at once."""
        waiter = Waiter(self, wake)
        with self._lock:
            frozen = self.frozen
            if frozen is None:
                first = not self._waiters
                self._waiters.add(waiter)
            else:
                waiter.verdict, waiter.cause = frozen, self._last_error
        if frozen is not None:
            _wake(waiter)
        elif first:
            self._kick.set()  # the pinger may be idling: schedule its next ping
        return waiter

    def _forget(self, waiter: Waiter) -> None:
        with self._lock:
            self._waiters.discard(waiter)

    # ------------------------------------------------------------- pinger

    def stop(self) -> None:
        """No client holds it any more: the thread ends after its current ping."""
        self._stopped = True
        self._kick.set()

    def _run(self) -> None:
        try:
            while not self._stopped:
                pause = self._until_due(time.monotonic())
                if pause > 0:
                    self._kick.wait(pause)
                    self._kick.clear()
                    continue
                self._check()
        finally:
            if self._on_stop is not None:
                with contextlib.suppress(Exception):
                    self._on_stop()

    def _until_due(self, now: float) -> float:
        """Seconds until the next ping is due; `every_s` (a re-check) when none is."""
        with self._lock:
            if self.frozen is not None:
                due = self._last_ping + self.policy.every_s
            elif self._waiters:
                oldest = min(w.started for w in self._waiters)
                due = max(self._last_ping + self.policy.every_s, oldest + self.policy.after_s)
            else:
                return self.policy.every_s
        return max(0.0, due - now)

    def _check(self) -> None:
        self._last_ping = time.monotonic()
        self.pings += 1
        try:
            self._ping(self.url + routes.HEALTH.path, self.policy.timeout_s)
        except httpx.TransportError as e:
            if refused(e):  # draining or dead, not frozen: its requests end by themselves
                log.debug("liveness ping of %s: connection refused (no verdict)", self.url)
            else:
                self._missed(e)
        except Exception as e:  # no answer and no miss: e.g. a closed event loop
            log.debug("liveness ping of %s could not run: %r", self.url, e)
        else:
            self._answered()

    def _missed(self, error: httpx.TransportError) -> None:
        with self._lock:
            self._misses += 1
            self._last_error = error
            if self.frozen is not None or self._misses < self.policy.misses:
                return
            self.frozen = (f"GET /health unanswered {self._misses} times in a row "
                           f"({self.policy.timeout_s:g}s each; {type(error).__name__})")
            waiters, self._waiters = self._waiters, set()
            for w in waiters:
                w.verdict, w.cause = self.frozen, error
        log.warning("replica %s is frozen: %s; its %d waiting requests go elsewhere",
                    self.url, self.frozen, len(waiters))
        for w in waiters:
            _wake(w)

    def _answered(self) -> None:
        with self._lock:
            was, self.frozen, self._misses = self.frozen, None, 0
        if was is not None:
            log.warning("replica %s answers GET /health again: back in use", self.url)


def _wake(waiter: Waiter) -> None:
    try:
        waiter.wake()
    except Exception as e:  # e.g. the waiting request's event loop closed
        log.debug("could not wake a request waiting on a frozen replica: %r", e)
