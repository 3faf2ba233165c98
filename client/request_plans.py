"""What the sync and async clients share: one call description, one retry
rule, one error type, and the plans that run them over the replica pool.

A plan is a generator that yields the I/O it wants done (`Send`, `Sleep`,
`Resolve`: plan_steps.py) and gets the outcome back; each client only
supplies that I/O, blocking or awaited, so the retry and routing logic exists
once.

Retries (at most `RetryPolicy.attempts` tries, and none begun after the
client's `timeout` since the call started) go to another replica if one is up;
with one replica, or all down, the plan waits for the first to come back:

- connect errors (the request surely did not reach the server) and
  502/503/504: the replica is skipped for what its `Retry-After` says (a
  draining or not-yet-ready server sets it), else an exponential backoff with
  full jitter;
- a frozen replica: the process-wide pinger (liveness.py) asks GET /health of
  every replica a request has waited on for a second, every 2 s; unanswered
  twice, the replica is frozen for every client of the process: no request
  goes there until it answers again, and each request waiting on it is given
  up and retried elsewhere. Besides, every `stall_timeout_s` a request has not
  answered, the client asks the replica's GET /health itself (see
  stall_watch.py); no answer: the request is given up, and the replica skipped
  by this client for `RetryPolicy.stall_down_s`. An answer to either: the
  replica is merely busy and keeps the request, however long it runs (it is
  never sent again: that would start the generation over, on what may by
  then be newer weights). With every replica frozen, a request waits for one
  to answer again, up to the client's `timeout`;
- a connection reset mid-request (the server died or restarted): skipped for
  the backoff. Sending a call again after it may have reached a server is safe
  here: every call is a read or a fresh sampling request.

A 409 naming `min_weight_version` (the replica does not serve it and none is
on the way) moves the request to a replica not yet tried, without counting as
a failed attempt; before such a request, replicas of unknown version are asked
for it (`learn_versions`). When no replica is left, the error names each one
and what happened to it.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import httpx

from rollout_sidecar.client.plan_steps import Plan, Resolve, Send, Sleep, Step, Watch
from rollout_sidecar.client.replica_pool import ReplicaPool
from rollout_sidecar.protocol.calls.failures import NEVER_SENT, RESET, STALLED
from rollout_sidecar.protocol.calls.stall_watch import Silent
from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.protocol.schema.generate_api import GenerateResponse

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Worth retrying: the server is starting, draining or momentarily unreachable.
RETRY_STATUS = {502, 503, 504}


class ReplicaFrozen(httpx.ReadTimeout):
    """The replica stopped answering GET /health while the request ran.
    `shared`: found by the process-wide pinger, whose verdict keeps it out of
    every pick until it answers; else by the request's own check."""

    shared = False

    @classmethod
    def after(cls, watch: Watch, silent: Silent) -> ReplicaFrozen:
        if silent.verdict is not None:
            frozen = cls(f"connected, then {silent.verdict}, by the process's liveness ping")
            frozen.shared = True
            return frozen
        return cls(f"connected, then silent for {watch.every_s:g}s; GET /health unanswered "
                   f"({type(silent.cause).__name__})")


# A liveness ping or version check is one small GET: a replica that cannot answer
# it within this (or the stall bound, if shorter) is frozen or gone.
PROBE_TIMEOUT_S = 5.0


class SidecarError(RuntimeError):
    """A request the server answered with an error (after any retries)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.field = field

    @classmethod
    def from_response(cls, r: httpx.Response) -> SidecarError:
        try:
            body = r.json()
            return cls(r.status_code, str(body.get("error", body)), body.get("field"))
        except ValueError:
            return cls(r.status_code, r.text[:500])


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `attempts` tries on connect errors and 502/503/504."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 60.0  # a longer Retry-After is capped, not obeyed
    stall_down_s: float = 30.0  # a frozen replica (connected, then silent) is skipped this long

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        after = retry_after_s(response) if response is not None else None
        if after is not None:
            return min(after, self.max_retry_after_s)
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))


def retry_after_s(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds (delta or HTTP date), None if absent or bad."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Timeouts:
    """The client's two bounds. `total_s`: every httpx timeout, and no retry
    begins after it since the call started. `stall_s`: how often a request
    still waiting checks that its replica lives (GET /health); None: never."""

    total_s: float = 300.0
    stall_s: float | None = 30.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(self.total_s)

    def watch(self, url: str) -> Watch:
        return Watch(url, self.stall_s, self.ping_s)

    @property
    def ping_s(self) -> float:
        return min(PROBE_TIMEOUT_S, self.stall_s or PROBE_TIMEOUT_S, self.total_s)


class Job(Protocol[T_co]):
    """Something a client can run: it describes its I/O as a plan."""

    def plan(self, pool: ReplicaPool, policy: RetryPolicy,
             timeouts: Timeouts = Timeouts()) -> Plan[T_co]: ...


@dataclass
class Call(Generic[T]):
    """One API call: what to send, how to read a successful answer, and the
    routing hints (`min_weight_version`, `session_key`, see replica_pool.py)."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    min_weight_version: int | None = None
    session_key: str | None = None

    def plan(self, pool: ReplicaPool, policy: RetryPolicy,
             timeouts: Timeouts = Timeouts()) -> Plan[T]:
        """Send to the pool's choice until one answers: the parsed answer, or
        the last error once retries (see the module docstring) are spent."""
        if pool.claim_refresh():
            yield Resolve()
        if self.min_weight_version is not None:
            yield from learn_versions(pool, policy, timeouts, self.min_weight_version)
        deadline = pool.clock() + timeouts.total_s
        failures = 0
        tried: set[str] = set()
        refused: set[str] = set()  # answered 409: min_weight_version is not there
        frozen: set[str] = set()
        seen: dict[str, str] = {}  # url -> what happened to it, for the final error
        retried: list[str] = []  # every try that did not answer, for the answer
        refusal: SidecarError | None = None
        last: tuple[httpx.TransportError | None, httpx.Response | None] = (None, None)
        while True:
            if refusal is not None and set(pool.urls()) <= refused:
                raise _exhausted(None, None, seen, refusal)  # none serves the version
            url = pool.pick(min_version=self.min_weight_version, session_key=self.session_key,
                            exclude=refused, tried=tried)
            if url is None:  # every candidate is down: look the name up again, or wait
                stuck = {u: f"frozen: {why}" for u, why in pool.frozen_urls().items()}
                seen = {**stuck, **seen}
                if failures and set(pool.urls()) <= frozen | refused | set(stuck):
                    raise _exhausted(*last, seen, refusal)  # nobody left to wait for
                if pool.clock() > deadline:  # frozen all along: waited long enough
                    if failures or refusal:
                        raise _exhausted(*last, seen, refusal)
                    raise _exhausted(ReplicaFrozen("no replica answers"), None, seen, refusal)
                yield Resolve() if pool.claim_refresh(force=True) else Sleep(pool.wait_s(refused))
                continue
            tried.add(url)
            response: httpx.Response | None = None
            error: httpx.TransportError | None = None
            try:
                response = yield Send(self.method, url + self.path, self.json,
                                      {"timeout": timeouts.httpx(), **self.kwargs},
                                      watch=timeouts.watch(url))
            except NEVER_SENT + STALLED + RESET as e:
                error = e
            finally:
                pool.done(url)
            if response is not None and response.status_code not in RETRY_STATUS:
                if not response.is_error:
                    return self._parsed(response, url, pool, retried)
                refusal = SidecarError.from_response(response)
                if not self._version_refused(refusal):
                    raise refusal
                seen[url] = f"refused: {refusal}"
                retried.append(f"{url}: {seen[url]}")
                refused.add(url)
                pool.saw_version(url, None)  # e.g. restarted on its checkpoint
                continue
            down_s, what = policy.delay(failures, response), _describe(error, response)
            if isinstance(error, ReplicaFrozen):
                frozen.add(url)  # the shared verdict keeps it out; its own check: stall_down_s
                down_s = 0.0 if error.shared else policy.stall_down_s
                what = f"frozen: {error}"
            elif isinstance(error, STALLED):
                what = f"no answer within {timeouts.total_s:g}s"
            elif isinstance(error, RESET):
                what = f"connection reset mid-request ({what})"
            seen[url] = what if error is None or not isinstance(error, NEVER_SENT) else (
                f"unreachable ({what})")
            retried.append(f"{url}: {seen[url]}")
            pool.mark_down(url, down_s, what)
            failures += 1
            last = (error, response)
            if failures >= policy.attempts or pool.clock() > deadline:
                raise _exhausted(error, response, seen, None)

    def _parsed(self, response: httpx.Response, url: str, pool: ReplicaPool,
                retried: list[str]) -> T:
        result = self.parse(response)
        # GenerateResponse and InfoResponse both say which version answered.
        version = getattr(result, "weight_version", None)
        if isinstance(version, int):
            pool.saw_version(url, version)
        if isinstance(result, GenerateResponse):  # says where it came from
            result.replica, result.retried = url, retried
        return result

    def _version_refused(self, error: SidecarError) -> bool:
        return (error.status == 409 and error.field == "min_weight_version"
                and self.min_weight_version is not None)


# A /ready poll is cheap; one hung replica must not stall the others' polls.
READY_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReadyCheck:
    """Wait until `min_ready` replicas (default: every one) answer GET /ready 200."""

    timeout: float
    poll_s: float
    min_ready: int | None = None

    def plan(self, pool: ReplicaPool, policy: RetryPolicy,
             timeouts: Timeouts = Timeouts()) -> Plan[None]:
        deadline = pool.clock() + self.timeout
        ready: list[str] = []
        while True:
            # No replica ready yet: maybe the dns+ name has new addresses.
            if pool.claim_refresh(force=not ready):
                yield Resolve()
            urls = pool.urls()
            need = len(urls) if self.min_ready is None else self.min_ready
            ready = []
            for url in urls:
                try:
                    r = yield Send("GET", url + routes.READY.path,
                                   kwargs={"timeout": READY_PROBE_TIMEOUT_S})
                except httpx.TransportError:
                    continue
                if r.status_code == 200:
                    ready.append(url)
                    pool.mark_up(url)
            if len(ready) >= need:
                return
            if pool.clock() > deadline:
                waiting = [u for u in urls if u not in ready]
                raise TimeoutError(f"{len(ready)} of {len(urls)} replicas ready, {need} needed, "
                                   f"after {self.timeout:.0f}s; not ready: {', '.join(waiting)}")
            yield Sleep(self.poll_s)


def learn_versions(pool: ReplicaPool, policy: RetryPolicy, timeouts: Timeouts,
                   min_version: int) -> Generator[Step, Any, None]:
    """Ask the replicas of unknown version for it (GET /info, a short timeout
    each) when none is known to hold `min_version`, so a fresh client's first
    try goes to a replica that holds it rather than to one restarted at v0."""
    for url in pool.claim_version_check(min_version):
        try:
            r = yield Send("GET", url + routes.INFO.path, kwargs={"timeout": timeouts.ping_s})
        except httpx.TransportError as e:
            if isinstance(e, STALLED):
                pool.mark_down(url, policy.stall_down_s, f"frozen: GET /info timed out ({e})")
            elif isinstance(e, NEVER_SENT + RESET):
                pool.mark_down(url, policy.delay(0), _describe(e, None))
            continue
        try:
            version = r.json().get("weight_version") if r.status_code == 200 else None
        except ValueError:
            version = None
        if isinstance(version, int):
            pool.saw_version(url, version)


def _exhausted(error: httpx.TransportError | None, response: httpx.Response | None,
               seen: dict[str, str], refusal: SidecarError | None) -> Exception:
    """The error for a call no replica could serve: the last one's type and
    status (callers catch those), with what happened at each replica."""
    summary = "; ".join(f"{url}: {what}" for url, what in seen.items())
    if error is None:
        last = refusal if response is None else SidecarError.from_response(response)
        assert last is not None
        return SidecarError(last.status, f"{last.message} [{summary}]", last.field)
    named = type(error)(f"no replica could serve the request: {summary}",
                        request=getattr(error, "_request", None))
    named.__cause__ = error
    return named


def _describe(error: Exception | None, response: httpx.Response | None) -> str:
    if error is not None:
        return f"{type(error).__name__}: {error}"
    return f"HTTP {response.status_code if response is not None else '?'}"
