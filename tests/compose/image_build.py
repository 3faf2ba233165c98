"""The compose test's images, built in the background from the start of the
session (tests/conftest.py starts it once collection picked the test).

Why: `deploy/docker/build.sh` on a fresh CI machine builds the base image,
the wheelhouse and both targets, minutes of mostly one core and disk; run in
the test itself, nothing overlapped it. Started at collection and waited for
by the test (which runs last), it overlaps the rest of the suite. A `quiet`
test waits for it first, like for a server start (tests/server_plan.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

BUILD_SH = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "build.sh"
# The images and the compose test's whole budget: a cold build took minutes.
BUILD_TIMEOUT_S = 1500.0


class ImageBuild:
    """`build.sh`, started once, in a session of its own (its docker
    clients end with it on a timeout)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self.started = 0.0

    def start(self, log: Path) -> None:
        if self.proc is not None:
            return
        self.log, self.started = log, time.monotonic()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(["bash", str(BUILD_SH)], stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=BUILD_SH.parents[2])

    def wait(self, timeout_s: float = BUILD_TIMEOUT_S) -> int | None:
        """build.sh's exit code (None if never started); on a timeout it is
        killed with its children and raises `subprocess.TimeoutExpired`."""
        if self.proc is None:
            return None
        left = max(1.0, timeout_s - (time.monotonic() - self.started))
        try:
            return self.proc.wait(left)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def stop(self) -> None:
        """End a build still running when the session ends (the compose test
        never ran: deselected at run time, or the session was cut short)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def settle(self) -> None:
        """Wait for a build in flight (before a `quiet` test); its result is
        the compose test's to report."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.wait()
            except subprocess.TimeoutExpired:
                pass


def docker_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


BUILD = ImageBuild()
