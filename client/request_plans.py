"""What the sync and async clients share: one call description, one retry
rule, one error type, and the plans that run them over the replica pool.

A plan is a generator that yields the I/O it wants done (`Send`, `Sleep`,
`Resolve`) and gets the outcome back; each client only supplies that I/O,
blocking or awaited, so the retry and routing logic exists once.

Retries (at most `RetryPolicy.attempts` tries): connect errors, where the
request surely did not reach the server (so safe for POST), and 502/503/504.
The replica that failed is marked down for what its `Retry-After` says (a
draining or not-yet-ready server sets it), else an exponential backoff with
full jitter, and the retry goes to another replica if one is up; with one
replica, or all down, it waits for the first to come back. A 409 naming
`min_weight_version` (the server waited for the version in vain) moves the
request to a replica not yet tried, without counting as a failed attempt.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import httpx

from rollout_sidecar.client.replica_pool import ReplicaPool

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Worth retrying: the server is starting, draining or momentarily unreachable.
RETRY_STATUS = {502, 503, 504}


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
class Send:
    """Send this request; the plan gets the response, or the transport
    error thrown in at its `yield`."""

    method: str
    url: str
    json: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Resolve:
    """Call `pool.refresh()`: blocking DNS, which the async client runs in a thread."""


Step = Send | Sleep | Resolve
Plan = Generator[Step, Any, T]


class Job(Protocol[T_co]):
    """Something a client can run: it describes its I/O as a plan."""

    def plan(self, pool: ReplicaPool, policy: RetryPolicy) -> Plan[T_co]: ...


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

    def plan(self, pool: ReplicaPool, policy: RetryPolicy) -> Plan[T]:
        """Send to the pool's choice until one answers: the parsed answer, or
        the last error once retries (see the module docstring) are spent."""
        if pool.claim_refresh():
            yield Resolve()
        failures = 0
        tried: set[str] = set()
        refused: set[str] = set()  # answered 409: min_weight_version did not arrive
        refusal: SidecarError | None = None
        while True:
            if refusal is not None and set(pool.urls()) <= refused:
                raise refusal  # every replica waited for the version in vain
            url = pool.pick(min_version=self.min_weight_version, session_key=self.session_key,
                            exclude=refused, tried=tried)
            if url is None:  # every candidate is down: look the name up again, or wait
                yield Resolve() if pool.claim_refresh(force=True) else Sleep(pool.wait_s(refused))
                continue
            tried.add(url)
            response: httpx.Response | None = None
            error: httpx.TransportError | None = None
            try:
                response = yield Send(self.method, url + self.path, self.json, self.kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                error = e  # never reached the server: safe to send elsewhere
            finally:
                pool.done(url)
            if response is not None and response.status_code not in RETRY_STATUS:
                if not response.is_error:
                    return self._parsed(response, url, pool)
                refusal = SidecarError.from_response(response)
                if not self._version_refused(refusal):
                    raise refusal
                refused.add(url)
                pool.saw_version(url, None)  # e.g. restarted on its checkpoint
                continue
            pool.mark_down(url, policy.delay(failures, response), _describe(error, response))
            failures += 1
            if failures >= policy.attempts:
                raise error if response is None else SidecarError.from_response(response)

    def _parsed(self, response: httpx.Response, url: str, pool: ReplicaPool) -> T:
        result = self.parse(response)
        # GenerateResponse and InfoResponse both say which version answered.
        version = getattr(result, "weight_version", None)
        if isinstance(version, int):
            pool.saw_version(url, version)
        return result

    def _version_refused(self, error: SidecarError) -> bool:
        return (error.status == 409 and error.field == "min_weight_version"
                and self.min_weight_version is not None)


# A /ready probe is cheap; one hung replica must not stall the others' polls.
READY_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReadyCheck:
    """Wait until `min_ready` replicas (default: every one) answer GET /ready 200."""

    timeout: float
    poll_s: float
    min_ready: int | None = None

    def plan(self, pool: ReplicaPool, policy: RetryPolicy) -> Plan[None]:
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
                    r = yield Send("GET", url + "/ready", kwargs={"timeout": READY_PROBE_TIMEOUT_S})
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


def _describe(error: Exception | None, response: httpx.Response | None) -> str:
    if error is not None:
        return f"{type(error).__name__}: {error}"
    return f"HTTP {response.status_code if response is not None else '?'}"
