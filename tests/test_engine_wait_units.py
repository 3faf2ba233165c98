"""On CPU the engine's shared-memory queue readers nap instead of spinning
on sched_yield (server/engine/idle_wait.py), unless engine_wait is spin. A
real vLLM MessageQueue, writer and reader in this process; no engine."""

from __future__ import annotations

import os
import threading
import time

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from rollout_sidecar.server.engine import idle_wait

MESSAGES = 40


@pytest.fixture
def yields(monkeypatch) -> list[int]:
    # Whatever the patch does to vLLM's module is undone after each test.
    monkeypatch.setattr(shm_broadcast, "SpinCondition", shm_broadcast.SpinCondition)
    monkeypatch.delenv(idle_wait.ENGINE_WAIT_ENV, raising=False)
    counted: list[int] = []
    real = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (counted.append(1), real())[1])
    return counted


def _send_with_gaps(spins: list[int] | None = None) -> list[object]:
    """MESSAGES through a real queue, 2 ms apart, so the reader waits for each.
    With `spins` (the yields counted), each message is sent only once the
    reader has yielded since the one before: a loaded machine may deschedule
    the reader until a message is already there, so a count of yields over
    fixed gaps measures the scheduler, not the loop (CI once saw 33 for 40)."""
    writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    got: list[object] = []

    def read() -> None:
        reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        got.extend(reader.dequeue(timeout=30) for _ in range(MESSAGES))

    t = threading.Thread(target=read)
    t.start()
    writer.wait_until_ready()
    for i in range(MESSAGES):
        time.sleep(0.002)
        if spins is not None:
            seen, deadline = len(spins), time.monotonic() + 10
            while len(spins) == seen:  # a reader that naps never yields: this fails
                assert time.monotonic() < deadline, f"no yield while message {i} was awaited"
                time.sleep(0.001)
        writer.enqueue(i)
    t.join(60)
    assert not t.is_alive()
    return got


def test_a_cpu_reader_naps_and_loses_nothing(yields):
    idle_wait.wait_idle_on_cpu()
    idle_wait.wait_idle_on_cpu()  # plugins load more than once: still one subclass
    assert shm_broadcast.SpinCondition.naps
    assert not getattr(shm_broadcast.SpinCondition.__mro__[1], "naps", False)
    assert _send_with_gaps() == list(range(MESSAGES))  # every message, in order
    assert yields == []


def test_engine_wait_spin_keeps_vllms_loop(yields, monkeypatch):
    monkeypatch.setenv(idle_wait.ENGINE_WAIT_ENV, "spin")
    idle_wait.wait_idle_on_cpu()
    assert not getattr(shm_broadcast.SpinCondition, "naps", False)
    # The reader spun (sched_yield) while it waited for each message.
    assert _send_with_gaps(spins=yields) == list(range(MESSAGES))
    assert len(yields) >= MESSAGES
