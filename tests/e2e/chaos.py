"""Faults for the chaos test (test_replicas.py): freeze a replica (SIGSTOP of
its server and engine processes) at one phase of a push, with clients
generating throughout, and measure what the issue's table asks for.

The phase hooks wrap one replica's admin-client call (or the data plane's
send of one bucket) in the in-process pusher, so the freeze lands exactly
there: the call then goes to a replica that is connected and silent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollout_sidecar.client import GenerationClient, RetryPolicy
from rollout_sidecar.protocol.failpoints import armed
from rollout_sidecar.server.launcher import process_tree

PHASES = ("begin", "transfer", "prepare", "commit", "probe")


class Freezer:
    """SIGSTOP a server's whole process tree; SIGCONT it back (idempotent)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pids: list[int] = []
        self.frozen_at: float | None = None

    def freeze(self) -> None:
        if self.frozen_at is None:
            self.pids = process_tree(self.pid)
            for p in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
            self.frozen_at = time.monotonic()

    def thaw(self) -> None:
        for p in reversed(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        self.frozen_at = None


@contextlib.contextmanager
def frozen_at(pusher, replica: int, phase: str, freezer: Freezer) -> Iterator[None]:
    """While the block runs, the pusher's `phase` on replica `replica` meets
    it frozen (the trainer's failpoints, protocol/failpoints.py)."""
    if phase == "transfer":  # before the second bucket: the data plane is mid-push
        def freeze(index, buf, rank=None):
            if index == 1:
                freezer.freeze()
        with armed("push.send", freeze):
            yield
        return
    target = (phase, pusher.replicas.admins[replica].base_url)

    def freeze(phase, url, rank=None):
        if (phase, url) == target and freezer.frozen_at is None:
            freezer.freeze()
    with armed("push.call", freeze):
        yield


@dataclass
class Traffic:
    """Client threads generating against every replica until stopped; each
    completion is kept as (monotonic time, weight_version)."""

    url: str
    token: str
    threads: int = 4
    stall_timeout_s: float = 5.0
    done: list[tuple[float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _run(self, i: int) -> None:
        retry = RetryPolicy(attempts=6, backoff_s=0.2, stall_down_s=10)
        with GenerationClient(self.url, api_token=self.token, retry=retry, timeout=120,
                              stall_timeout_s=self.stall_timeout_s) as c:
            while not self._stop.is_set():
                try:
                    r = c.generate([f"chaos {i}"], sampling=dict(max_tokens=4))
                    self.done.append((time.monotonic(), r.weight_version))
                except Exception as e:  # kept for the report; the test asserts on them
                    self.errors.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> Traffic:
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(self.threads)]
        for t in self._workers:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(150)

    def per_10s(self, start: float, end: float) -> float:
        n = sum(1 for t, _ in self.done if start <= t <= end)
        return 10 * n / max(end - start, 1e-9)

    def versions(self, start: float, end: float) -> set[int]:
        return {v for t, v in self.done if start <= t <= end}


def timed(call: Callable[[], object]) -> tuple[float, object | BaseException]:
    """(seconds, result or the exception it raised)."""
    t0 = time.monotonic()
    try:
        out: object | BaseException = call()
    except BaseException as e:  # the chaos test inspects it
        out = e
    return time.monotonic() - t0, out


@contextlib.contextmanager
def thawed_after(freezer: Freezer) -> Iterator[Freezer]:
    try:
        yield freezer
    finally:
        freezer.thaw()
