"""Waiting on a long call without cutting a slow replica off.

A non-streamed call (a /generate, a push phase) sends no byte until it is
done, so silence on its connection cannot tell a frozen replica from a busy
one: a read timeout short enough to catch the first would cut the second off
and make it start over. Instead the call runs with its full budget, and every
`every_s` it has not answered, a second, tiny request asks the replica whether
it lives (its HTTP process answers that alone, never queued behind the
engine). A live replica keeps the call, however long it runs; one that cannot
answer the liveness check in time is frozen, and the call is given up at once.
A refused check is not silence (liveness.refused): a draining replica still
finishes the call, a dead one's connection resets. The
clients also hand the process-wide verdict of liveness.py in (`shared`): a
call is given up as soon as that pinger finds its replica frozen, well before
its own check (every `stall_timeout_s`) would have asked.

Used by the clients (GET /health beside a /generate) and by the pusher's
control calls (GET /ready beside connect, prepare, commit; see
trainer/control/deadlines.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from rollout_sidecar.protocol.calls.liveness import ReplicaLiveness, Waiter, refused

T = TypeVar("T")


class Silent(Exception):
    """The liveness check failed while the watched call was still running;
    `cause` is its transport error. `verdict`: set when the process-wide
    pinger (liveness.py), not this call's own check, found the replica frozen."""

    def __init__(self, cause: httpx.TransportError, verdict: str | None = None) -> None:
        super().__init__(verdict or f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.verdict = verdict


def _silent(waiter: Waiter) -> Silent:
    cause = waiter.cause or httpx.ReadTimeout(waiter.verdict or "frozen")
    return Silent(cause, waiter.verdict)


def run_watched(call: Callable[[], T], alive: Callable[[], None], every_s: float | None,
                shared: ReplicaLiveness | None = None) -> T:
    """`call()` in a daemon thread, calling `alive()` (which raises an
    httpx.TransportError for a replica that does not answer) every `every_s`
    it runs (None: never), and given up at once if `shared` finds the replica
    frozen meanwhile. A failed check raises `Silent` and leaves `call` to end by
    its own timeout, in the background: a daemon thread never holds up the
    interpreter's exit."""
    box: dict[str, object] = {}
    done = threading.Event()
    wake = threading.Event()  # set by the call's end or by the shared verdict

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e
        done.set()
        wake.set()

    threading.Thread(target=run, daemon=True, name="rollout-sidecar-watched-call").start()
    waiter = shared.wait(wake.set) if shared is not None else None
    try:
        while True:
            woken = wake.wait(every_s)
            if done.is_set():
                break
            if waiter is not None and waiter.verdict is not None:
                raise _silent(waiter)
            if woken:
                continue
            try:
                alive()
            except httpx.TransportError as e:
                if done.is_set():  # the answer came while we asked
                    break
                if refused(e):  # draining or dead (liveness.refused): the call ends by itself
                    continue
                raise Silent(e) from e
    finally:
        if waiter is not None:
            waiter.close()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


async def run_watched_async(call: Awaitable[T], alive: Callable[[], Awaitable[None]],
                            every_s: float | None,
                            shared: ReplicaLiveness | None = None) -> T:
    """`run_watched` for asyncio: a failed check cancels the call."""
    task = asyncio.ensure_future(call)
    loop = asyncio.get_running_loop()
    frozen: asyncio.Future[None] = loop.create_future()

    def wake() -> None:  # from the pinger's thread
        def settle() -> None:
            if not frozen.done():
                frozen.set_result(None)

        loop.call_soon_threadsafe(settle)

    waiter = shared.wait(wake) if shared is not None else None
    try:
        while True:
            either: set[asyncio.Future[Any]] = {task, frozen}
            done, _ = await asyncio.wait(either, timeout=every_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            if waiter is not None and waiter.verdict is not None:
                raise _silent(waiter)
            if done:
                continue
            try:
                await alive()
            except httpx.TransportError as e:
                if task.done():
                    return task.result()
                if refused(e):  # draining or dead (liveness.refused): the call ends by itself
                    continue
                raise Silent(e) from e
    finally:
        if not task.done():
            task.cancel()
        frozen.cancel()
        if waiter is not None:
            waiter.close()
