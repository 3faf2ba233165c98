"""Retry policy and error type shared by the sync and async clients."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

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
    """Exponential backoff with full jitter on connect errors and 502/503/504."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))


def should_retry(exc: Exception | None, response: httpx.Response | None) -> bool:
    if exc is not None:
        # Only errors where the request surely did not run: safe even for POST.
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    return response is not None and response.status_code in RETRY_STATUS


def settle(policy: RetryPolicy, attempt: int, exc: Exception | None,
           response: httpx.Response | None) -> httpx.Response | None:
    """The response to return, None to retry, or raise the final error."""
    if should_retry(exc, response) and attempt < policy.attempts - 1:
        return None
    if exc is not None:
        raise exc
    assert response is not None
    if response.is_error:
        raise SidecarError.from_response(response)
    return response


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
