"""The servers one pusher feeds: every replica's admin client, called side by
side, with each replica's answer or error kept apart.

Every listed replica that answers takes part in every push; one that is not
there yet or is leaving sits a push out (`leave_out`, decided by
serving_state.py), and the next push lists it again. The replicas are called at
once (a thread each), so a push's control-plane round trips cost one
replica's latency however many there are. `each` keeps every replica's answer
or error apart, for the steps that must know which replica refused
(two_phase.py); `all` raises naming every replica that failed, for the steps
where any failure ends the push.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollout_sidecar.protocol.schema.endpoints import expand_urls
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from rollout_sidecar.trainer.control.deadlines import Deadlines
from rollout_sidecar.trainer.errors import ReplicaError, WeightPushError

T = TypeVar("T")


class ReplicaAdmins:
    """One `WeightAdminClient` per replica; `urls` as `expand_urls` reads
    them (a list, a comma-separated string, or a `dns+` headless Service)."""

    def __init__(self, urls: str | Sequence[str] | None, token: str | None,
                 deadlines: Deadlines | None = None) -> None:
        self.spec = urls
        self.token = token
        self.deadlines = deadlines or Deadlines()
        self.listed: list[WeightAdminClient] = []  # every replica the URLs name
        self.admins: list[WeightAdminClient] = []  # those this push goes to
        self.absent: dict[str, str] = {}  # listed, sitting this push out: url -> why
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the URL list (a `dns+` name may resolve to new pods) and
        take every listed replica into the push again; True if the list
        changed."""
        urls = expand_urls(self.spec)
        self.absent = {}
        changed = urls != [a.base_url for a in self.listed]
        if changed:
            self.close()
            self.listed = [WeightAdminClient(u, self.token, self.deadlines) for u in urls]
        self.admins = list(self.listed)
        return changed

    def leave_out(self, absent: dict[str, str]) -> None:
        """This push goes on without `absent` (url -> why: joining, leaving)."""
        self.absent = dict(absent)
        self.admins = [a for a in self.listed if a.base_url not in absent]

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
        try:
            with ThreadPoolExecutor(len(self.admins)) as pool:
                return list(pool.map(one, range(len(self.admins))))
        except RuntimeError as e:
            # At interpreter exit (a pusher closed then, trainer/release.py) no pool
            # takes work any more: one replica after the other.
            if "shutdown" not in str(e):
                raise
            return [one(i) for i in range(len(self.admins))]

    def all(self, call: Callable[[WeightAdminClient, int], T], what: str) -> list[T]:
        """Like `each`, but raise naming every replica that failed."""
        results = self.each(call)
        errors = [(u, r) for u, r in zip(self.urls, results, strict=True)
                  if isinstance(r, Exception)]
        if errors:
            raise failed_on(what, errors, len(results))
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for a in self.listed:
            a.close()


def failed_on(what: str, errors: Sequence[tuple[str, Exception]], of: int) -> WeightPushError:
    """The error of a step that failed on `errors`' replicas, of `of`."""
    return WeightPushError(f"{what} failed on {len(errors)} of {of} replicas: " + named(errors))


def named(errors: Sequence[tuple[str, Exception]]) -> str:
    """Each replica's error, led by its URL (a `ReplicaError` names it itself)."""
    return "; ".join(str(e) if isinstance(e, ReplicaError) else f"{u}: {e}" for u, e in errors)


def failures(results: Sequence[Any]) -> list[int]:
    """The indexes of the replicas whose call raised."""
    return [i for i, r in enumerate(results) if isinstance(r, Exception)]
