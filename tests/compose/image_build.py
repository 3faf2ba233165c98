"""The compose test's images, built in the background from the start of the
session (tests/conftest.py starts it once collection picked the test).

Why: `deploy/docker/build.sh` on a fresh CI machine builds the base image,
the wheelhouse and both targets, minutes of mostly one core and disk; run in
the test itself, nothing overlapped it. Started at collection and waited for
by the test (which runs late, before tests/fidelity), it overlaps most of the
suite. A `quiet` test waits for it first, like for a server start
(tests/server_plan.py).

A full `bash tests/run.sh` starts it even earlier, beside the venv's pip
install (one core, minutes, on a fresh machine), in a folder it names in
`ROLLOUT_SIDECAR_IMAGE_BUILD_DIR` (`pid`, then `rc` and `build.log`); the
session adopts that build instead of starting another.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

BUILD_SH = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "build.sh"
# The images and the compose test's whole budget: a cold build took minutes.
BUILD_TIMEOUT_S = 1500.0
# Set by tests/run.sh when it started the build itself (see the top).
STARTED_DIR_ENV = "ROLLOUT_SIDECAR_IMAGE_BUILD_DIR"


class StartedBuild:
    """The build tests/run.sh started (`setsid`, so its pid is its process
    group), seen through its folder; `poll`/`wait` as on a `Popen`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pid = int((folder / "pid").read_text())

    def poll(self) -> int | None:
        rc = self.folder / "rc"
        if rc.exists() and rc.read_text().strip():
            return int(rc.read_text())
        try:  # killed before it could write rc (or a zombie of this process)
            gone = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        return -9 if gone else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["bash", str(BUILD_SH)], timeout or 0)
            time.sleep(1.0)
        return rc


def started_build() -> StartedBuild | None:
    folder = os.environ.get(STARTED_DIR_ENV)
    if not folder:
        return None
    pid = Path(folder) / "pid"
    deadline = time.monotonic() + 30  # written at once by a shell started minutes ago
    while not pid.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return StartedBuild(Path(folder))


class ImageBuild:
    """`build.sh`, started once, in a session of its own (its docker
    clients end with it on a timeout)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | StartedBuild | None = None
        self.log: Path | None = None
        self.started = 0.0

    def start(self, log: Path | None = None) -> None:
        """Adopt tests/run.sh's build, or start one logging to `log` (a
        folder of its own in the temp dir if None)."""
        if self.proc is not None:
            return
        self.started = time.monotonic()
        if (early := started_build()) is not None:  # tests/run.sh's
            self.proc, self.log = early, early.folder / "build.log"
            return
        if log is None:
            log = Path(tempfile.mkdtemp(prefix="rollout-sidecar-images-")) / "build.log"
        self.log = log
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
        if self.proc is None:
            self.proc = started_build()
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
