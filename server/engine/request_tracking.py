"""Which requests are in the engine, and the weight version each finished on.

A response names the versions that produced its tokens (version_gate.py). A
commit with the "keep" policy publishes a new version while requests run, so
each request's finish version must be pinned at the right moment: when its
last output is read, or, if that output already waits in its queue when a
commit publishes, just before the publish (`freeze_finished`). Both /generate
(generate/service.py) and the /v1 routes (openai_api/compat.py) register their
requests here so that a commit sees all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_sidecar.server.engine.version_gate import VersionGate

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import Collector


@dataclass(eq=False)
class Track:
    """One submitted prompt: its output queue, and the version it finished on.
    With a lag bound (`max_lag`): the version its current run started under
    (`since`), and whether a commit stopped that run to start it again."""

    collector: Collector
    finish_version: int | None = None
    max_lag: int | None = None
    since: int = 0
    restart: bool = False
    restarts: int = 0


async def abort_quietly(abort: Awaitable[Any]) -> None:
    """Await an engine abort even while our own task is being cancelled.

    A request whose client went away must still be freed in the engine; the
    shield lets the abort finish, and its errors are dropped because the
    caller is already raising the error that matters."""
    with contextlib.suppress(Exception):
        await asyncio.shield(abort)


class RequestTracker:
    """The set of requests a commit must pin finish versions for."""

    def __init__(self, gate: VersionGate) -> None:
        self.gate = gate
        self.tracks: set[Track] = set()

    def watch(self, collector: Collector) -> Track:
        """Track one submitted request (its vLLM output collector)."""
        track = Track(collector)
        self.tracks.add(track)
        return track

    def watch_all(self, tracks: list[Track]) -> None:
        self.tracks.update(tracks)

    def unwatch(self, track: Track) -> None:
        self.tracks.discard(track)

    def unwatch_all(self, tracks: list[Track]) -> None:
        self.tracks.difference_update(tracks)

    async def final(self, track: Track) -> Any:
        """The request's last output; its finish version is the served one
        when it is read, unless a commit froze it earlier."""
        q = track.collector
        while True:
            # Drain without awaiting when possible, as AsyncLLM.generate does.
            out = q.get_nowait() or await q.get()
            if out.finished:
                if track.finish_version is None:
                    track.finish_version = self.gate.version
                return out

    def too_far_behind(self, version: int) -> list[Track]:
        """Called by a `keep` commit once it published `version`: the running
        prompts whose oldest token would now be more than their `max_lag`
        behind, marked to start again. A run's oldest token came at or after
        `since`; one that finished (frozen before the publish) is left alone."""
        behind = [t for t in self.tracks if t.max_lag is not None and not t.restart
                  and t.finish_version is None and version - t.since > t.max_lag]
        for t in behind:
            t.restart = True
        return behind

    def freeze_finished(self) -> None:
        """Called by a commit just before it publishes: requests whose final
        output already waits in their queue finished on the current version,
        however late their coroutine reads it."""
        for t in self.tracks:
            pending = getattr(t.collector, "output", None)
            # vLLM >= 0.33 parks a request's error there too (output_processor.py).
            if t.finish_version is None and getattr(pending, "finished", False):
                t.finish_version = self.gate.version
