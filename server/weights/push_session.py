r"""The push state machine: one push at a time, every transition under one lock.

    IDLE --begin--> RECEIVING --commit--> COMMITTING --> IDLE (committed | failed)
                      |   \--prepare--> CHECKING --> PREPARED --commit--/
                      |                     (fails)     \--abort / deadline--> IDLE
                      \--abort / deadline / dead trainer / bad bucket--> IDLE

A push ended by an abort (POST /weights/abort, its trainer's reconnect, server
shutdown) is recorded as `aborted`; one ended any other way without a commit, as
`failed`.

`prepare` is phase 1 of a commit across replicas: the buckets arrived and
passed their CRCs, nothing is loaded; the trainer commits (phase 2) only once
every replica prepared, and aborts them all otherwise.

- `begin` is bound to the connection that carries the data.
- `commit` is idempotent: a duplicate of a commit in progress waits for it and
  gets the same answer; a commit of a push already ended gets its recorded
  outcome. Nothing else can act on a push once it is COMMITTING: an abort then
  answers 409 with the reason, and the commit finishes.
- `prepare` is idempotent the same way, and a prepared push gets a new
  deadline for its phase 2.
- `abort` is idempotent for a push already aborted or failed.
- A failure anywhere (pause, receive, check, load) leaves the state IDLE with
  the reason recorded, and the gate open.

The model changes only in a commit's load (commit.py), after every bucket
arrived and passed its CRC, and the load refuses (model untouched) before its
point of no return; past that point a failure marks the gate broken (503
until a push succeeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rollout_sidecar.protocol.schema import BeginRequest, CommitResponse, LastPush
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.errors import PushConflict

log = logging.getLogger(__name__)


class PushFailed(Exception):
    """A commit step failed; the push ends (the cleanup ends vLLM's update
    session on every worker, whatever each one's state)."""


class PushState(str, Enum):
    IDLE = "idle"
    RECEIVING = "receiving"
    CHECKING = "checking"
    PREPARED = "prepared"
    COMMITTING = "committing"


@dataclass(eq=False)
class Push:
    push_id: str
    req: BeginRequest
    policy: str
    started: float
    deadline: float
    state: PushState = PushState.RECEIVING
    outcome: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                    .create_future())
    prepared: asyncio.Future | None = None  # set by the first prepare
    patch_s: float | None = None  # a delta: its patches' seconds, after its check (commit.py)

    @property
    def distributed(self) -> bool:
        """Its bytes come over the trainer's data-plane group (protocol/transports.py)."""
        return transport(self.req.transport).joins_group


class PushSession:
    def __init__(self, on_failed: Callable[[Push, str, str], Awaitable[None]]) -> None:
        self.lock = asyncio.Lock()
        self.current: Push | None = None
        self.last: LastPush | None = None
        # push_id -> CommitResponse or LastPush, for idempotent repeats.
        self.ended: OrderedDict[str, CommitResponse | LastPush] = OrderedDict()
        self._on_failed = on_failed

    @property
    def state(self) -> PushState:
        return self.current.state if self.current else PushState.IDLE

    def new_push(self, req: BeginRequest, policy: str, timeout_s: float) -> Push:
        now = time.monotonic()
        return Push(uuid.uuid4().hex, req, policy, now, now + timeout_s)

    def require(self, push_id: str, *states: PushState) -> Push:
        """The current push if it is `push_id` in one of `states`, else a 409."""
        p = self.current
        if p is not None and p.push_id == push_id and p.state in states:
            return p
        if p is not None and p.push_id == push_id:
            raise PushConflict(f"push {push_id} is {p.state.value}, not "
                               f"{' or '.join(s.value for s in states)}")
        ended = self.ended.get(push_id)
        if isinstance(ended, CommitResponse):
            raise PushConflict(f"push {push_id} already committed as version "
                               f"{ended.weight_version}")
        if isinstance(ended, LastPush):
            raise PushConflict(f"push {push_id} already {ended.outcome}: {ended.reason}")
        raise PushConflict(f"push {push_id} is not in progress")

    def _record(self, push: Push, result: CommitResponse | LastPush) -> None:
        self.ended[push.push_id] = result
        while len(self.ended) > 256:
            self.ended.popitem(last=False)
        if self.current is push:
            self.current = None
        if not push.outcome.done():
            push.outcome.set_result(result)

    def committed(self, push: Push, resp: CommitResponse) -> None:
        self._record(push, resp)
        self.last = LastPush(version=push.req.version, outcome="committed", push_id=push.push_id)

    async def fail(self, push: Push, reason: str, outcome: str = "failed") -> bool:
        """End `push` (lock held by the caller). False if it already ended."""
        if push.push_id in self.ended:
            return False
        last = LastPush(version=push.req.version, outcome=outcome, reason=reason,
                        push_id=push.push_id)
        self._record(push, last)
        self.last = last
        with contextlib.suppress(Exception):
            await self._on_failed(push, reason, outcome)
        return True

    async def commit(self, push_id: str, run: Callable[[Push], Awaitable[CommitResponse]]
                     ) -> CommitResponse:
        """Run the commit once; repeats of the same push get the same answer."""
        async with self.lock:
            ended = self.ended.get(push_id)
            if ended is not None:
                return _answer(ended)
            p = self.current
            if p is not None and p.push_id == push_id and p.state is PushState.COMMITTING:
                pass  # a duplicate: wait for the first one below
            else:
                p = self.require(push_id, PushState.RECEIVING, PushState.PREPARED)
                p.state = PushState.COMMITTING
                asyncio.get_running_loop().create_task(self._run(p, run))
        return _answer(await asyncio.shield(p.outcome))

    async def prepare(self, push_id: str, run: Callable[[Push], Awaitable[None]],
                      phase2_s: float) -> Push:
        """Run phase 1 once (RECEIVING -> CHECKING -> PREPARED); repeats wait
        for it. A failure ends the push like any other."""
        async with self.lock:
            p = self.current
            if p is None or p.push_id != push_id or p.prepared is None:
                p = self.require(push_id, PushState.RECEIVING)
                p.state = PushState.CHECKING
                p.prepared = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().create_task(self._prepare(p, run, phase2_s))
            prepared = p.prepared
        done = await asyncio.shield(asyncio.wait(
            [prepared, p.outcome], return_when=asyncio.FIRST_COMPLETED))
        if prepared in done[0] and not p.outcome.done():
            return p
        ended = self.ended.get(push_id)
        if isinstance(ended, LastPush):
            raise PushConflict(f"push rejected ({ended.outcome}): {ended.reason}")
        return p  # committed meanwhile: prepared it was

    async def _prepare(self, push: Push, run: Callable[[Push], Awaitable[None]],
                       phase2_s: float) -> None:
        ok, _ = await self._attempt(push, run)
        if not ok:
            return
        async with self.lock:
            if self.current is push and push.state is PushState.CHECKING:
                push.state = PushState.PREPARED
                push.deadline = time.monotonic() + phase2_s
            if push.prepared is not None and not push.prepared.done():
                push.prepared.set_result(True)

    async def _run(self, push: Push, run: Callable[[Push], Awaitable[CommitResponse]]) -> None:
        ok, resp = await self._attempt(push, run)
        if ok:
            async with self.lock:
                self.committed(push, resp)

    async def _attempt(self, push: Push, run: Callable[[Push], Awaitable[Any]]
                       ) -> tuple[bool, Any]:
        """One phase's work, outside the lock; a failure ends the push."""
        try:
            return True, await run(push)
        except Exception as e:
            async with self.lock:
                await self.fail(push, str(e))
            return False, None


def _answer(result: CommitResponse | LastPush) -> CommitResponse:
    if isinstance(result, CommitResponse):
        return result
    raise PushConflict(f"push rejected ({result.outcome}): {result.reason}")
