"""The steps of a request plan (request_plans.py) and how a client walks
one: a plan yields the I/O it wants done (`Send` a request, `Sleep`,
`Resolve` the replica names again) and gets each step's `Outcome` back. Both
clients walk plans with `next_step`, so the sync and the async one differ
only in how they run a step (generation_client.py).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rollout_sidecar.protocol.schema import routes

T = TypeVar("T")


@dataclass(frozen=True)
class Watch:
    """While the request runs on `replica`: given up if the process-wide
    pinger finds it frozen (liveness.py), and every `every_s` (None: never)
    GET `ping_url` (bounded by `ping_s`); either raises `ReplicaFrozen` at
    the plan's `yield`."""

    replica: str
    every_s: float | None
    ping_s: float

    @property
    def ping_url(self) -> str:
        return self.replica + routes.HEALTH.path


@dataclass(frozen=True)
class Send:
    """Send this request; the plan gets the response, or the transport
    error thrown in at its `yield`."""

    method: str
    url: str
    json: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    watch: Watch | None = None


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Resolve:
    """Call `pool.refresh()`: blocking DNS, which the async client runs in a thread."""


Step = Send | Sleep | Resolve
Plan = Generator[Step, Any, T]


@dataclass(frozen=True)
class Outcome:
    """What running a step gave the plan: a reply, or the transport error
    it decides on (retry elsewhere, or raise)."""

    reply: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Done(Generic[T]):
    value: T


def next_step(plan: Plan[T], outcome: Outcome | None) -> Step | Done[T]:
    """The plan's first step (`outcome` None), or its next after `outcome`;
    `Done` with its result once it returns. Both clients walk plans with it,
    so the sync and the async one differ only in how they run a step."""
    try:
        if outcome is None:
            return next(plan)
        if outcome.error is not None:
            return plan.throw(outcome.error)
        return plan.send(outcome.reply)
    except StopIteration as done:
        return Done(done.value)
