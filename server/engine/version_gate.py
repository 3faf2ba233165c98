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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from rollout_sidecar.server.errors import ServiceUnavailable


class MinVersionTimeout(Exception):
    """The requested `min_weight_version` did not arrive in time."""


class Lease:
    """One request's hold on the gate, released by `submitted` and `finished`
    (each idempotent, each safe in a `finally`)."""

    def __init__(self, gate: VersionGate, version: int) -> None:
        self.gate = gate
        self.version = version
        self._submitting = self._in_flight = True

    def submitted(self) -> None:
        if self._submitting:
            self._submitting = False
            self.gate._count("submitting", -1)

    def finished(self) -> None:
        self.submitted()
        if self._in_flight:
            self._in_flight = False
            self.gate._count("in_flight", -1)


class VersionGate:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.history: list[int] = [version]
        self.modes: dict[int, str] = {}  # version -> pause mode of the commit that made it
        self.broken: str | None = None
        # version -> why its post-push probe failed; tagged on every response
        # that any of these versions produced.
        self.suspect: dict[int, str] = {}
        self.gated = 0  # requests held at admission now (for metrics)
        self.last_hold_s = 0.0  # how long the last commit kept admissions shut
        self._committing = False
        self._cond = asyncio.Condition()
        self._counts = {"submitting": 0, "in_flight": 0}
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

        Raises `MinVersionTimeout` after `timeout_s` if the version never
        came; without `min_version` a request waits only for a running commit,
        which is itself bounded (drain bound + load).
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
                        await asyncio.wait_for(self._cond.wait_for(ready), timeout_s)
                except (asyncio.TimeoutError, TimeoutError) as e:  # distinct on 3.10
                    raise MinVersionTimeout(
                        f"weight_version {min_version} not reached within {timeout_s:.0f}s; "
                        f"server holds {self.version}") from e
                finally:
                    self.gated -= 1
            if self.broken is not None:
                raise ServiceUnavailable(self.broken)
            # No await between the check above and these: a commit cannot slip in.
            self._count("submitting", 1)
            self._count("in_flight", 1)
            return Lease(self, self.version)

    @contextlib.asynccontextmanager
    async def commit_window(self, policy: str, drain_s: float) -> AsyncIterator[str]:
        """Shut admissions, drain, and yield the pause mode to use: `policy`,
        or `abort` if a `wait` drain ran past `drain_s`."""
        async with self._cond:
            self._committing = True
        t0 = time.monotonic()
        try:
            mode = policy
            # Submissions take milliseconds; the bound only guards a dead engine.
            await _wait(self._idle["submitting"], drain_s)
            if policy == "wait" and not await _wait(self._idle["in_flight"], drain_s):
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
            self._cond.notify_all()

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
