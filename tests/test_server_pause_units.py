"""Units for tests/server_pause.py on real processes: a paused server is
stopped with every process it started, spends no CPU, and runs again when
continued; pausing one that has exited does nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import server_pause
from tests.polling import until

# A parent that starts a child; both spin, counting, until killed.
TREE = """
import subprocess, sys
spin = "while True: pass"
child = subprocess.Popen([sys.executable, "-c", spin])
print(child.pid, flush=True)
exec(spin)
"""


def state(pid: int) -> str:
    """`R`, `S`, `T` (stopped), ... from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_paused_tree_is_stopped_spends_nothing_and_runs_again():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    child: int | None = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert server_pause.pause(parent) and server_pause.paused(parent)
        assert not server_pause.pause(parent)  # paused already
        until(lambda: state(parent.pid) == state(child) == "T", "both processes stopped", 10)
        ticks = cpu_ticks(parent.pid), cpu_ticks(child)
        time.sleep(0.3)  # a span in which a running spinner would count ticks
        assert (cpu_ticks(parent.pid), cpu_ticks(child)) == ticks
        assert server_pause.resume(parent) and not server_pause.paused(parent)
        until(lambda: "T" not in (state(parent.pid), state(child)),
              "both processes running again", 10)
        assert not server_pause.resume(parent)  # not paused: nothing to do
    finally:
        server_pause.resume_all()
        if child is not None:  # the child first: once its parent is gone, it is init's
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(10)


def test_a_process_that_exited_is_not_paused():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert not server_pause.pause(proc) and not server_pause.paused(proc)
