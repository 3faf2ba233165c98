"""The servers one pusher feeds: every replica's admin client, called side by
side, with each replica's answer or error kept apart.

A push is all-or-nothing across them: each replica begins and receives; then
`prepare` (phase 1: every bucket arrived and passed its CRC) runs on all, and
only if all of them prepared does `commit` (phase 2: load and serve) run
anywhere. One that fails before the commit makes the pusher abort the push
everywhere, so the previous version keeps serving on every replica and no
response ever carries a version another replica refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from rollout_sidecar.client.server_urls import expand_urls
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient, WeightPushError

T = TypeVar("T")
Outcome = Literal["committed", "refused", "aborted", "failed"]


@dataclass
class ReplicaOutcome:
    """One replica's part in one push."""

    url: str
    outcome: Outcome
    weight_version: int | None = None  # what it serves after the push
    reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


class ReplicaSet:
    def __init__(self, urls: str | Sequence[str] | None, token: str | None) -> None:
        self.spec = urls
        self.token = token
        self.admins: list[WeightAdminClient] = []
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the URL list (a `dns+` name may resolve to new pods); True
        if it changed."""
        urls = expand_urls(self.spec)
        if urls == [a.base_url for a in self.admins]:
            return False
        self.close()
        self.admins = [WeightAdminClient(u, self.token) for u in urls]
        return True

    @property
    def urls(self) -> list[str]:
        return [a.base_url for a in self.admins]

    def each(self, call: Callable[[WeightAdminClient, int], T]) -> list[T | Exception]:
        """`call(admin, i)` on every replica at once; each result or its error."""
        def one(i: int) -> T | Exception:
            try:
                return call(self.admins[i], i)
            except Exception as e:
                return e

        if len(self.admins) == 1:
            return [one(0)]
        with ThreadPoolExecutor(len(self.admins)) as pool:
            return list(pool.map(one, range(len(self.admins))))

    def all(self, call: Callable[[WeightAdminClient, int], T], what: str) -> list[T]:
        """Like `each`, but raise naming every replica that failed."""
        results = self.each(call)
        errors = [(u, r) for u, r in zip(self.urls, results, strict=True)
                  if isinstance(r, Exception)]
        if errors:
            raise WeightPushError(f"{what} failed on {len(errors)} of {len(results)} "
                                  "replicas: " + "; ".join(f"{u}: {e}" for u, e in errors))
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for a in self.admins:
            a.close()


def describe(outcomes: list[ReplicaOutcome]) -> str:
    return "; ".join(f"{o.url}: {o.outcome}" + (f" ({o.reason})" if o.reason else "")
                     for o in outcomes)


def failures(results: list[Any]) -> list[int]:
    return [i for i, r in enumerate(results) if isinstance(r, Exception)]
