"""Ends a push whose trainer died or stalled, so nothing waits forever.

A push holds the server's one push slot and vLLM's update session from
`begin` until it commits or aborts. A trainer that crashes mid-push calls
neither, so every push gets a watcher from `begin` on that fails it:

- when its deadline passes (`push_timeout_s` from begin, renewed once the
  push is prepared: phase 2 gets its own deadline), or
- as soon as the worker's background receive failed (gloo/NCCL only: an HTTP
  push fails in the request that carried the bad bucket).

The watcher leaves alone a push that is checking (the CHECK op is bounded by
the push's deadline itself) or committing (a commit always finishes).
"""

from __future__ import annotations

import asyncio
import time

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.weights.data_plane import DataPlane
from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.push_session import Push, PushSession, PushState

# How often a push is looked at: the latency of noticing a dead receive.
WATCH_S = 0.5


class PushWatchdog:
    def __init__(self, session: PushSession, plane: DataPlane, settings: ServerSettings) -> None:
        self.session = session
        self.plane = plane
        self.settings = settings

    def start(self, push: Push) -> asyncio.Task:
        """Watch `push` until it ends (call from begin, on the event loop)."""
        return asyncio.get_running_loop().create_task(self.run(push))

    async def run(self, push: Push) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            async with self.session.lock:
                if self.session.current is not push or push.state is PushState.COMMITTING:
                    return
                if push.state is PushState.CHECKING:  # bounded by the CHECK op's timeout
                    continue
                if time.monotonic() > push.deadline:
                    phase = "prepared, but not committed" if push.state is PushState.PREPARED \
                        else "not committed"
                    await self.session.fail(push, f"deadline of {self.settings.push_timeout_s:.0f}"
                                            f"s passed: {phase}")
                    return
                if push.distributed and push.state is PushState.RECEIVING:
                    # A side op: answered without entering vLLM's update session.
                    state = await self.plane.side(SideOp.STATE)
                    if state["receive"] == "failed":
                        await self.session.fail(push, f"receive failed: {state['receive_error']}")
                        return
