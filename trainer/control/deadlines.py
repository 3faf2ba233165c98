"""Every wait of a push, derived from one setting: `PushConfig.stall_timeout_s`.

A push can fail in two ways that need different clocks. A replica can be
*slow* (a large load, a long drain): only the phase's budget should end that,
and the server's `push_timeout_s` sets it. Or it can be *stalled* (frozen,
paused, partitioned: connected, then silent): that should end as soon as it
is clear, whatever the budget. So a stall is measured as lack of progress,
never as elapsed time:

- the data plane: the group's per-operation timeout is `stall_s`, so a bucket
  piece that does not move for that long fails the transfer on every rank
  (gloo and NCCL time out each send and receive on their own). Forming the
  group is a one-off with its own budget, `join_s`, since a cold first
  connect can take longer than a stall; the connect call is watched;
- a quick control call (status, index, abort, disconnect) gets `stall_s` as
  its HTTP timeout: an answer takes milliseconds;
- a long control call (connect, begin, prepare, commit, probe) may take its
  phase's budget, but is *watched*: every `heartbeat_s` without an answer,
  the replica's GET /ready (answered by the HTTP process alone, never queued
  behind the engine) must answer within `stall_s`, else the replica is frozen
  and the call is given up at once.

With the default 15 s a frozen replica fails a push within about 30 s of
freezing: one stall bound to notice, one for the abort that cannot reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from rollout_sidecar.protocol.calls.stall_watch import Silent, run_watched

T = TypeVar("T")

# Time a replica's HTTP server has to accept a connection: a live one does it
# in milliseconds, so a longer wait means down or partitioned.
CONNECT_S = 5.0


@dataclass(frozen=True)
class Deadlines:
    stall_s: float = 15.0
    """No progress for this long is a stall, in any phase of a push."""
    join_s: float = 120.0
    """Forming the data-plane group (a one-off per connection, slow when cold)."""

    @property
    def quick(self) -> httpx.Timeout:
        """A control call that answers at once."""
        return httpx.Timeout(self.stall_s, connect=min(CONNECT_S, self.stall_s))

    def long(self, budget_s: float) -> httpx.Timeout:
        """A watched call: the phase's budget, the liveness watch does the rest."""
        return httpx.Timeout(budget_s, connect=min(CONNECT_S, self.stall_s))

    @property
    def heartbeat_s(self) -> float:
        """How long a long call waits before asking the replica if it lives."""
        return min(5.0, self.stall_s / 3)

    @property
    def group_timeout_s(self) -> float:
        """The data-plane group's per-operation timeout, once it formed."""
        return self.stall_s


class Stalled(Exception):
    """The replica stopped answering while a watched call was in flight."""

    def __init__(self, silent_s: float, cause: BaseException) -> None:
        super().__init__(f"connected, then silent for {silent_s:g}s (GET /ready unanswered: "
                         f"{type(cause).__name__})")
        self.cause = cause


def watched(call: Callable[[], T], alive: Callable[[], None], deadlines: Deadlines) -> T:
    """`call()`, asking `alive()` (which raises for a replica that does not
    answer) every `heartbeat_s` it runs; a dead liveness check raises
    `Stalled` (see protocol/calls/stall_watch.py)."""
    try:
        return run_watched(call, alive, deadlines.heartbeat_s)
    except Silent as e:
        raise Stalled(deadlines.stall_s, e.cause) from e.cause
