"""What the sync and async clients share: one call description, one retry
rule, one error type. Each client only supplies the I/O (send, sleep).

Retries: connect failures are retried by httpx's own transport (`retries=`),
which retries only errors where the request surely did not reach the server,
so it is safe for POST. On top of that, 502/503/504 are retried here, waiting
what the server's `Retry-After` says (a draining or not-yet-ready server sets
it), else an exponential backoff with full jitter.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

T = TypeVar("T")

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


@dataclass
class Call(Generic[T]):
    """One API call: what to send, and how to read a successful answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Attempts:
    """The retry loop's state, shared by both clients' loops:
    `outcome(response)` is the response to return, None to retry (after
    `wait_s`), or raises the final error."""

    policy: RetryPolicy
    attempt: int = 0
    wait_s: float = 0.0

    def outcome(self, response: httpx.Response) -> httpx.Response | None:
        if response.status_code in RETRY_STATUS and self.attempt < self.policy.attempts - 1:
            self.wait_s = self.policy.delay(self.attempt, response)
            self.attempt += 1
            return None
        if response.is_error:
            raise SidecarError.from_response(response)
        return response


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
