"""Units for tests/server_plan.py's look-ahead, with fake starts (no engine):
the next `LOOKAHEAD` servers always start; more start only while the cores
idle, up to `MAX_AHEAD` waiting, never during a `quiet` test, never past the
memory guard; the monitor sees starts become ready, pauses them and fills
idle by itself; the session's end continues and stops every start that
still runs.

Each test builds a plan of its own with a fake `Machine`: nothing here
patches the class, the module or psutil, which the session's own plan (and
its monitor thread, running beside these tests) reads."""

from __future__ import annotations

import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from tests import server_plan
from tests.server_plan import (
    IDLE_BUSY,
    Machine,
    ServerPlan,
    ServerSpec,
    busy_share,
    memory_to_spare,
    patched,
    surface,
)

IDLE, BUSY = IDLE_BUSY - 0.2, IDLE_BUSY + 0.1


class FakeStart:
    """A launched server that is ready when the test says so."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.stopped = False
        self.paused = False
        self.proc = self  # stop_process(proc.proc) and proc.proc.poll() get this

    def is_ready(self) -> bool:
        return self.up.is_set()

    def wait_ready(self, timeout_s: float = 300) -> None:
        assert self.up.wait(timeout_s), "fake start never became ready"

    def poll(self) -> int | None:
        return 0 if self.stopped else None


def stop(proc: FakeStart) -> None:
    assert not proc.paused, "a paused server was stopped: it would never take the SIGTERM"
    proc.stopped = True


def pause(proc: FakeStart) -> bool:
    was, proc.paused = proc.paused, True
    return not was


def resume(proc: FakeStart) -> bool:
    was, proc.paused = proc.paused, False
    return was


def fake_plan(tmp_path: Path, **machine) -> tuple[ServerPlan, dict[str, FakeStart]]:
    """A plan of 8 specs whose starts are `FakeStart`s (its own `Machine`:
    memory always to spare unless `machine` says otherwise)."""
    starts: dict[str, FakeStart] = {}

    def launch(folder: Path, spec: ServerSpec, **overrides) -> FakeStart:
        starts[spec.name] = FakeStart()
        return starts[spec.name]

    machine = {"launch": launch, "stop": stop, "pause": pause, "resume": resume,
               "spare": lambda starting: True, **machine}
    p = ServerPlan([ServerSpec(f"s{i}") for i in range(8)], lookahead=2, max_ahead=4,
                   machine=Machine(**machine))
    p.root = tmp_path
    return p, starts


@pytest.fixture
def plan(tmp_path: Path):
    p, starts = fake_plan(tmp_path)
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


def test_no_start_ahead_without_memory_for_it(tmp_path):
    spare_answers = iter([True, True])  # prefetch's two starts; then none

    def spare(starting: int) -> bool:
        seen.append(starting)
        return next(spare_answers, False)

    seen: list[int] = []
    p, starts = fake_plan(tmp_path, spare=spare)
    p.prefetch()
    ready(p, starts, "s0")
    assert not p.fill_idle(IDLE) and seen == [0, 0, 1]  # s1's start in flight counted
    p.close()


def test_memory_to_spare_counts_each_start_in_flight():
    gib = server_plan.MIN_AVAILABLE_GIB + server_plan.START_GIB + 0.1
    available = gib * 2**30
    assert memory_to_spare(0, available) and memory_to_spare(1, available)
    assert not memory_to_spare(2, available)


Times = namedtuple("Times", "user system idle iowait")


def test_busy_share_counts_idle_and_iowait_as_not_busy():
    assert busy_share(Times(0, 0, 0, 0), Times(30, 10, 50, 10)) == pytest.approx(0.4)
    assert busy_share(Times(1, 1, 1, 1), Times(1, 1, 1, 1)) == 1.0  # no time passed


def test_the_monitor_sees_starts_ready_and_fills_idle_cores(tmp_path):
    clock = iter(range(10**6))

    def idle_machine() -> Times:  # 10% busy between any two samples
        t = next(clock)
        return Times(t, 0, 9 * t, 0)

    p, starts = fake_plan(tmp_path, cpu_times=idle_machine, monitor_s=0.01)
    p.prefetch()
    starts["s0"].up.set()
    starts["s1"].up.set()
    p.start_monitor()
    deadline = time.monotonic() + 10
    while len(starts) < 4:
        assert time.monotonic() < deadline, f"the monitor launched only {sorted(starts)}"
        threading.Event().wait(0.01)
    assert starts["s0"].paused and starts["s1"].paused  # ready, waiting: no CPU spent
    assert not starts["s2"].paused  # not ready yet
    p.close()  # joins the monitor: nothing can launch after it returns
    assert sorted(starts) == ["s0", "s1", "s2", "s3"]
    assert not p.monitor.is_alive() and not p.todo
    assert all(s.stopped and not s.paused for s in starts.values())  # continued, then stopped


def test_settle_waits_for_the_monitor_to_see_each_start_ready_or_gone(tmp_path):
    """Before a `quiet` test; never asks a start itself (it may be paused)."""
    clock = iter(range(10**6))

    def busy_machine() -> Times:  # 100% busy: the monitor launches nothing more
        t = next(clock)
        return Times(t, 0, 0, 0)

    p, starts = fake_plan(tmp_path, cpu_times=busy_machine, monitor_s=0.01)
    p.prefetch()
    p.start_monitor()
    settled = threading.Thread(target=p.settle)
    settled.start()
    settled.join(0.2)
    assert settled.is_alive()  # s0 and s1 still starting
    starts["s0"].up.set()
    stop(starts["s1"])  # a start that failed is done starting too
    settled.join(10)
    assert not settled.is_alive() and starts["s0"].paused
    p.close()


def test_the_end_stops_every_start_still_running_taken_or_not(plan):
    p, starts = plan
    p.prefetch()  # s0, s1 launched
    with p.lock:  # a test took s0 and never stopped it (its fixture failed half way)
        p.launched.pop(ServerSpec("s0"))
    stop(starts["s1"])  # ...and one is gone already
    p.close()
    assert starts["s0"].stopped and not p.started


def test_a_patch_of_what_the_session_plan_reads_is_seen(monkeypatch):
    """The check tests/conftest.py runs after every test: the class, the
    module and psutil's calls, each patched, are named (undone before this
    test's own call ends, so the check passes for it)."""
    before = surface()
    for target, name, value in [(ServerPlan, "_launch", lambda *a: None),
                                (server_plan, "MONITOR_S", 0.01),
                                (server_plan.psutil, "cpu_times", lambda: None)]:
        with monkeypatch.context() as m:
            m.setattr(target, name, value)
            assert patched(before, surface()), name
    assert patched(before, surface()) == []
