"""Waiting on a long call without cutting a slow replica off.

A non-streamed call (a /generate, a push phase) sends no byte until it is
done, so silence on its connection cannot tell a frozen replica from a busy
one: a read timeout short enough to catch the first would cut the second off
and make it start over. Instead the call runs with its full budget, and every
`every_s` it has not answered, a second, tiny request asks the replica whether
it lives (its HTTP process answers that alone, never queued behind the
engine). A live replica keeps the call, however long it runs; one that cannot
answer the liveness check is frozen, and the call is given up at once.

Used by the clients (GET /health beside a /generate) and by the pusher's
control calls (GET /ready beside connect, prepare, commit; see
trainer/control/deadlines.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


class Silent(Exception):
    """The liveness check failed while the watched call was still running;
    `cause` is its transport error."""

    def __init__(self, cause: httpx.TransportError) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def run_watched(call: Callable[[], T], alive: Callable[[], None], every_s: float) -> T:
    """`call()` in a daemon thread, calling `alive()` (which raises an
    httpx.TransportError for a replica that does not answer) every `every_s`
    it runs. A failed check raises `Silent` and leaves `call` to end by its own
    timeout, in the background: a daemon thread never holds up the
    interpreter's exit."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name="rollout-sidecar-watched-call").start()
    while not done.wait(every_s):
        try:
            alive()
        except httpx.TransportError as e:
            if done.is_set():  # the answer came while we asked
                break
            raise Silent(e) from e
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


async def run_watched_async(call: Awaitable[T], alive: Callable[[], Awaitable[None]],
                            every_s: float) -> T:
    """`run_watched` for asyncio: a failed check cancels the call."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            try:
                await alive()
            except httpx.TransportError as e:
                if task.done():
                    return task.result()
                raise Silent(e) from e
    finally:
        if not task.done():
            task.cancel()
