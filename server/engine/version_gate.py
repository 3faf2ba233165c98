"""Orders /generate requests against weight commits, so version tags are true.

A request takes a `Lease` at admission. It holds the lease's *submit* side
until the engine has accepted all of its prompts, and its *in-flight* side
until it finished. A commit (`commit_window`) first stops admissions, then
waits for every submit hold (short), and under policy `wait` for every
in-flight request too. That drain is ours, not vLLM's: vLLM's
`pause_generation(mode="wait")` drains only running sequences and leaves the
scheduler's waiting queue queued, so those requests ran on the new weights
under the old tag. The drain is bounded (`drain_s`); past it the commit falls
back to `abort`. So under `wait` and `abort` every token of a request comes
from the version it was admitted under; under `keep` the request reports the
versions live from admission to its last token.

A failed load that got past the point of no return marks the gate `broken`:
admissions answer 503 until a push succeeds, so half-loaded weights never
serve under a version number.

A request for a `min_weight_version` the server does not hold waits for it
(bounded) only while a push is in flight (`push_pending`, set by the weight
service): with none, nothing will bring the version, so it is refused at once
and the client can ask a replica that holds it (issue 20: a replica restarted
at v0 held clients for the whole wait before answering 409).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from rollout_sidecar.server.errors import ServiceUnavailable

# Retry-After of a refused min_weight_version: when asking this replica again
# may find the version (a trainer pushes to every replica within seconds).
VERSION_RETRY_AFTER_S = 1
# How often a request waiting for a version checks that a push is still in flight.
PUSH_POLL_S = 0.5


class MinVersionTimeout(Exception):
    """The requested `min_weight_version` did not arrive in time, or cannot
    (no push in flight). Answered 409 with `Retry-After: retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = VERSION_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SubmissionsStuck(RuntimeError):
    """A commit found requests still being submitted after its drain bound."""


class Lease:
    """One request's hold on the gate, released by `submitted` and `finished`
    (each idempotent, each safe in a `finally`)."""

    def __init__(self, gate: VersionGate, version: int) -> None:
        self.gate = gate
        self.version = version
        self._submitting = self._in_flight = True
        gate.leases[version] = gate.leases.get(version, 0) + 1

    def submitted(self) -> None:
        if self._submitting:
            self._submitting = False
            self.gate._count("submitting", -1)

    def finished(self) -> None:
        self.submitted()
        if self._in_flight:
            self._in_flight = False
            self.gate._count("in_flight", -1)
            left = self.gate.leases[self.version] - 1
            if left:
                self.gate.leases[self.version] = left
            else:
                del self.gate.leases[self.version]


class VersionGate:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.history: list[int] = [version]
        self.modes: dict[int, str] = {}  # version -> pause mode of the commit that made it
        self.broken: str | None = None
        self.published = 0  # commits published since start (a catch-up's too)
        # version -> why its post-push probe failed; tagged on every response
        # that any of these versions produced.
        self.suspect: dict[int, str] = {}
        self.gated = 0  # requests held at admission now (for metrics)
        self.last_hold_s = 0.0  # how long the last commit kept admissions shut
        self._committing = False
        # True while a push is begun and not yet committed or failed. None:
        # nobody tells (a bare gate in unit tests), so wait as if one were.
        self.push_pending: Callable[[], bool] | None = None
        self._cond = asyncio.Condition()
        self._counts = {"submitting": 0, "in_flight": 0}
        # version -> requests admitted under it and not finished (a LoRA
        # adapter stays loaded while one of its requests runs).
        self.leases: dict[int, int] = {}
        self._idle = {k: asyncio.Event() for k in self._counts}
        for e in self._idle.values():
            e.set()

    def _count(self, key: str, delta: int) -> None:
        self._counts[key] += delta
        if self._counts[key] == 0:
            self._idle[key].set()
        else:
            self._idle[key].clear()

    @property
    def in_flight(self) -> int:
        return self._counts["in_flight"]

    async def admit(self, min_version: int | None, timeout_s: float) -> Lease:
        """Wait until no commit is running and `version >= min_version`.

        Raises `MinVersionTimeout` at once if the version is missing and no
        push is in flight, or after `timeout_s` if the push in flight did not
        bring it; without `min_version` a request waits only for a running
        commit, which is itself bounded (drain bound + load).
        """
        def ready() -> bool:
            return not self._committing and (min_version is None or self.version >= min_version)

        async with self._cond:
            if not ready():
                self.gated += 1
                try:
                    if min_version is None or self.version >= min_version:
                        await self._cond.wait_for(ready)
                    else:
                        await self._wait_for_version(ready, min_version, timeout_s)
                finally:
                    self.gated -= 1
            if self.broken is not None:
                raise ServiceUnavailable(self.broken)
            # No await between the check above and these: a commit cannot slip in.
            self._count("submitting", 1)
            self._count("in_flight", 1)
            return Lease(self, self.version)

    def _no_push(self) -> bool:
        return not self._committing and self.push_pending is not None and not self.push_pending()

    async def _wait_for_version(self, ready: Callable[[], bool], min_version: int,
                                timeout_s: float) -> None:
        """Under the condition's lock: wait for `ready`, in slices, so that a
        push that ends without the version (failed, aborted, or another
        version) refuses the waiters at once instead of at `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if self._no_push() or left <= 0:
                why = ("is not served and no push is in flight" if left > 0 else
                       f"not reached within {timeout_s:.0f}s")
                raise MinVersionTimeout(f"weight_version {min_version} {why}; server holds "
                                        f"{self.version}")
            try:
                await asyncio.wait_for(self._cond.wait_for(ready), min(left, PUSH_POLL_S))
            except (asyncio.TimeoutError, TimeoutError):  # distinct on 3.10
                pass

    @contextlib.asynccontextmanager
    async def commit_window(self, policy: str, drain_s: float, drain: bool = True
                            ) -> AsyncIterator[str]:
        """Shut admissions, drain, and yield the pause mode to use: `policy`,
        or `abort` if a `wait` drain ran past `drain_s`. Without `drain`
        (an adapter commit: requests in flight keep their own adapter) only
        submissions are waited for."""
        async with self._cond:
            self._committing = True
        t0 = time.monotonic()
        try:
            mode = policy
            # Submissions take milliseconds; the bound only guards a dead
            # engine. None may still be on its way once the engine pauses:
            # vLLM 0.32 queued it, 0.33 refuses it (`engine_paused`,
            # v1/engine/core.py `_reject_add_while_paused`), so the commit
            # fails instead, the old weights serving.
            if not await _wait(self._idle["submitting"], drain_s):
                raise SubmissionsStuck(f"requests still being submitted to the engine "
                                       f"after {drain_s:.0f}s: it is not taking requests; "
                                       "nothing was loaded")
            if policy == "wait" and drain and not await _wait(self._idle["in_flight"], drain_s):
                mode = "abort"
            yield mode
        finally:
            async with self._cond:
                self._committing = False
                self.last_hold_s = time.monotonic() - t0
                self._cond.notify_all()

    async def publish(self, version: int, mode: str = "wait") -> None:
        async with self._cond:
            self.version = version
            self.history.append(version)
            del self.history[:-1024]
            self.modes = {v: m for v, m in self.modes.items() if v in self.history}
            self.modes[version] = mode
            for v in [v for v in self.suspect if v not in self.history]:
                del self.suspect[v]
            self.broken = None  # a committed push is a known state again
            self.published += 1
            self._cond.notify_all()

    async def wait_published(self, count: int) -> None:
        """Return once more than `count` commits were published."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.published > count)

    def versions_between(self, start: int, end: int) -> list[int]:
        """Versions that produced tokens of a request admitted under `start`
        whose last token came under `end`. Only a `keep` commit lets a request
        run on: a `wait` commit drained it first, an `abort` commit ended it."""
        versions = [start]
        for v in self.history:
            if start < v <= end:
                if self.modes.get(v) != "keep":
                    break
                versions.append(v)
        return versions


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    except (asyncio.TimeoutError, TimeoutError):
        return False
