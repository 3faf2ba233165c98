"""Orders /generate requests against weight commits.

A request is admitted only while no commit is in progress, and only once the
server holds the `min_weight_version` it asked for. So the version a request
records at admission is the version its tokens come from (the commit waits for
it under policy `wait`, aborts it under `abort`), and a request can never see a
half-loaded model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class MinVersionTimeout(Exception):
    """The requested `min_weight_version` did not arrive in time."""


class VersionGate:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.history: list[int] = [version]
        self._committing = False
        self._cond = asyncio.Condition()
        self.gated = 0  # requests currently held here (for metrics)
        # version -> why its post-push probe failed; tagged on every response
        # that any of these versions produced.
        self.suspect: dict[int, str] = {}

    async def admit(self, min_version: int | None, timeout_s: float) -> int:
        """Wait until no commit is running and `version >= min_version`.

        Raises `MinVersionTimeout` after `timeout_s` if the version never came;
        a request without `min_version` waits only for a running commit, which
        is itself bounded by the push deadline.
        """
        def ready() -> bool:
            return not self._committing and (min_version is None or self.version >= min_version)

        async with self._cond:
            if ready():
                return self.version
            self.gated += 1
            try:
                if min_version is None or self.version >= min_version:
                    await self._cond.wait_for(ready)
                else:
                    await asyncio.wait_for(self._cond.wait_for(ready), timeout_s)
            except TimeoutError as e:
                raise MinVersionTimeout(
                    f"weight_version {min_version} not reached within {timeout_s:.0f}s; "
                    f"server holds {self.version}"
                ) from e
            finally:
                self.gated -= 1
            return self.version

    @contextlib.asynccontextmanager
    async def committing(self) -> AsyncIterator[None]:
        """Hold new requests at the gate while the weights are swapped."""
        async with self._cond:
            self._committing = True
        try:
            yield
        finally:
            async with self._cond:
                self._committing = False
                self._cond.notify_all()

    async def publish(self, version: int) -> None:
        async with self._cond:
            self.version = version
            self.history.append(version)
            del self.history[:-1024]
            for v in [v for v in self.suspect if v not in self.history]:
                del self.suspect[v]
            self._cond.notify_all()

    def versions_between(self, start: int, end: int) -> list[int]:
        """Versions that were live while a request ran from `start` to `end`."""
        if start == end:
            return [start]
        return sorted({v for v in self.history if start <= v <= end} | {start, end})
