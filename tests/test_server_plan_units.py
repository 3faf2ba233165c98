"""Units for tests/server_plan.py's look-ahead, with fake starts (no engine):
a start that becomes ready launches the next at once, at most `LOOKAHEAD`
starts are in flight and `MAX_AHEAD` servers wait untaken, a `quiet` test
launches nothing, and memory holds starts back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests import server_plan
from tests.server_plan import ServerPlan, ServerSpec


class FakeStart:
    """A launched server whose start ends when the test says so."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.proc = self  # stop_process(proc.proc) gets this

    def wait_ready(self, timeout_s: float = 300) -> None:
        assert self.ready.wait(timeout_s), "fake start never became ready"

    def poll(self) -> int | None:
        return None


@pytest.fixture
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    starts: dict[str, FakeStart] = {}

    def launch(self, spec: ServerSpec, **overrides) -> FakeStart:
        starts[spec.name] = FakeStart()
        return starts[spec.name]

    monkeypatch.setattr(ServerPlan, "_launch", launch)
    monkeypatch.setattr(server_plan, "stop_process", lambda proc: None)
    monkeypatch.setattr(server_plan, "memory_to_spare", lambda starting=0: True)
    p = ServerPlan([ServerSpec(f"s{i}") for i in range(8)], lookahead=2, max_ahead=4)
    p.root = tmp_path
    yield p, starts
    for s in starts.values():
        s.ready.set()
    p.close()


def until(cond, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met within 10 s"
        time.sleep(0.01)


def test_a_ready_start_launches_the_next_without_waiting_for_a_test(plan):
    p, starts = plan
    p.prefetch()
    assert sorted(starts) == ["s0", "s1"]  # two in flight, no more
    starts["s0"].ready.set()  # no test boundary in between: the watcher launches
    until(lambda: "s2" in starts)
    assert "s3" not in starts
    starts["s1"].ready.set()
    starts["s2"].ready.set()
    until(lambda: "s3" in starts)
    # Four launched and untaken (three ready, one starting): the cap holds.
    time.sleep(0.2)
    assert sorted(starts) == ["s0", "s1", "s2", "s3"]
    with p.lock:  # a test takes s0 (what `take` does, without the engine)
        p.launched.pop(ServerSpec("s0"))
    p.prefetch()
    assert "s4" in starts


def test_a_quiet_test_launches_nothing_and_waits_for_starts_in_flight(plan):
    p, starts = plan
    p.prefetch()
    p.set_quiet(True)
    settled = threading.Thread(target=p.settle)
    settled.start()
    time.sleep(0.1)
    assert settled.is_alive()  # s0 and s1 are still starting
    starts["s0"].ready.set()
    starts["s1"].ready.set()
    settled.join(10)
    assert not settled.is_alive()
    time.sleep(0.2)
    assert sorted(starts) == ["s0", "s1"]  # the watchers launched nothing while quiet
    p.set_quiet(False)
    assert sorted(starts) == ["s0", "s1", "s2", "s3"]


def test_no_start_ahead_without_memory_for_it(plan, monkeypatch):
    p, starts = plan
    seen: list[int] = []

    def spare(starting: int = 0) -> bool:
        seen.append(starting)
        return starting < 1  # room for one start at a time

    monkeypatch.setattr(server_plan, "memory_to_spare", spare)
    p.prefetch()
    assert sorted(starts) == ["s0"] and seen == [0, 1]


def test_memory_to_spare_counts_each_start_in_flight(monkeypatch):
    class Mem:
        available = (server_plan.MIN_AVAILABLE_GIB + server_plan.START_GIB + 0.1) * 2**30

    monkeypatch.setattr(server_plan.psutil, "virtual_memory", lambda: Mem)
    assert server_plan.memory_to_spare(0) and server_plan.memory_to_spare(1)
    assert not server_plan.memory_to_spare(2)


def test_closing_stops_the_watchers_from_launching(plan):
    p, starts = plan
    p.prefetch()
    p.close()
    starts["s0"].ready.set()
    time.sleep(0.2)
    assert sorted(starts) == ["s0", "s1"]
