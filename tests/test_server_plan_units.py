"""Units for tests/server_plan.py's look-ahead, with fake starts (no engine):
the next `LOOKAHEAD` servers always start; more start only while the cores
idle, up to `MAX_AHEAD` waiting, never during a `quiet` test, never past the
memory guard; the monitor sees starts become ready and fills idle by itself."""

from __future__ import annotations

import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from tests import server_plan
from tests.server_plan import IDLE_BUSY, ServerPlan, ServerSpec, busy_share

IDLE, BUSY = IDLE_BUSY - 0.2, IDLE_BUSY + 0.1


class FakeStart:
    """A launched server that is ready when the test says so."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.proc = self  # stop_process(proc.proc) and proc.proc.poll() get this

    def is_ready(self) -> bool:
        return self.up.is_set()

    def wait_ready(self, timeout_s: float = 300) -> None:
        assert self.up.wait(timeout_s), "fake start never became ready"

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
    p.close()


def ready(p: ServerPlan, starts: dict[str, FakeStart], *names: str) -> None:
    for name in names:  # what the monitor does when it sees them ready
        starts[name].up.set()
        p.ready.add(ServerSpec(name))


def test_the_next_servers_always_start_and_more_only_on_idle_cores(plan):
    p, starts = plan
    p.prefetch()
    assert sorted(starts) == ["s0", "s1"]
    ready(p, starts, "s0", "s1")
    assert not p.fill_idle(BUSY) and sorted(starts) == ["s0", "s1"]
    assert p.fill_idle(IDLE) and p.fill_idle(IDLE)  # s2, s3
    assert not p.fill_idle(IDLE)  # two starts in flight: no third
    ready(p, starts, "s2", "s3")
    assert not p.fill_idle(IDLE)  # MAX_AHEAD (4) wait untaken
    assert sorted(starts) == ["s0", "s1", "s2", "s3"]
    with p.lock:  # a test takes s0 (what `take` does, without the engine)
        p.launched.pop(ServerSpec("s0"))
    assert p.fill_idle(IDLE) and "s4" in starts


def test_a_quiet_test_launches_nothing(plan):
    p, starts = plan
    p.prefetch()
    ready(p, starts, "s0", "s1")
    p.set_quiet(True)
    p.settle()
    assert not p.fill_idle(IDLE) and sorted(starts) == ["s0", "s1"]
    p.set_quiet(False)
    assert p.fill_idle(IDLE)


def test_no_start_ahead_without_memory_for_it(plan, monkeypatch):
    p, starts = plan
    p.prefetch()
    ready(p, starts, "s0")
    seen: list[int] = []

    def spare(starting: int = 0) -> bool:
        seen.append(starting)
        return False

    monkeypatch.setattr(server_plan, "memory_to_spare", spare)
    assert not p.fill_idle(IDLE) and seen == [1]  # s1's start in flight counted


def test_memory_to_spare_counts_each_start_in_flight(monkeypatch):
    class Mem:
        available = (server_plan.MIN_AVAILABLE_GIB + server_plan.START_GIB + 0.1) * 2**30

    monkeypatch.setattr(server_plan.psutil, "virtual_memory", lambda: Mem)
    assert server_plan.memory_to_spare(0) and server_plan.memory_to_spare(1)
    assert not server_plan.memory_to_spare(2)


Times = namedtuple("Times", "user system idle iowait")


def test_busy_share_counts_idle_and_iowait_as_not_busy():
    assert busy_share(Times(0, 0, 0, 0), Times(30, 10, 50, 10)) == pytest.approx(0.4)
    assert busy_share(Times(1, 1, 1, 1), Times(1, 1, 1, 1)) == 1.0  # no time passed


def test_the_monitor_sees_starts_ready_and_fills_idle_cores(plan, monkeypatch):
    p, starts = plan
    clock = iter(range(10**6))

    def idle_machine() -> Times:  # 10% busy between any two samples
        t = next(clock)
        return Times(t, 0, 9 * t, 0)

    monkeypatch.setattr(server_plan.psutil, "cpu_times", idle_machine)
    monkeypatch.setattr(server_plan, "MONITOR_S", 0.01)
    p.prefetch()
    starts["s0"].up.set()
    starts["s1"].up.set()
    p.start_monitor()
    deadline = time.monotonic() + 10
    while len(starts) < 4:
        assert time.monotonic() < deadline, f"the monitor launched only {sorted(starts)}"
        threading.Event().wait(0.01)
    p.close()  # joins the monitor: nothing can launch after it returns
    assert sorted(starts) == ["s0", "s1", "s2", "s3"]
    assert not p.monitor.is_alive() and not p.todo
