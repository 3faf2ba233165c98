"""The test zygote (tests/server_zygote.py) forks a child that is what
`subprocess.Popen` of the same command would have started: its argv,
environment, working directory, output, session and passed sockets (at the
same numbers), its exit status and signals as Popen reports them; and a
command it cannot serve as such gets a real Popen. A light module stands in
for the server (tests/zygote_probe.py); the servers themselves are proven by
every e2e test that takes a planned one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.server_zygote import ForkedProcess, Zygote

PROBE = "tests.zygote_probe"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    env = {**os.environ, "ROLLOUT_SIDECAR_PROBE": "zygote's"}
    z = Zygote(tmp_path_factory.mktemp("zygote"), env, modules=(PROBE,), preload=("json",))
    assert z.ready(60), z.log.read_text()
    yield z
    z.close()
    assert z.proc.returncode is not None


def start(zygote, tmp_path, then: str, env=None, new_session=False):
    ours, theirs = socket.socketpair()
    log = tmp_path / f"{then}.log"
    with open(log, "w") as out:
        proc = zygote.popen([sys.executable, "-m", PROBE, str(theirs.fileno()), then],
                            env=env or {**zygote.env, "ROLLOUT_SIDECAR_PROBE": "the child's"},
                            stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=new_session, pass_fds=[theirs.fileno()])
    theirs.close()
    return proc, ours, log


def test_a_forked_child_gets_what_popen_would_give_it(zygote, tmp_path):
    proc, ours, log = start(zygote, tmp_path, "3", new_session=True)
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(60) == 3 and proc.poll() == 3
    ours.settimeout(10)
    assert ours.recv(100) == b"through the passed fd"
    got = json.loads(log.read_text().splitlines()[-1])
    assert got["name"] == "__main__" and got["argv"][0].endswith("zygote_probe.py")
    assert got["argv"][2] == "3" and got["cwd"] == os.getcwd()
    assert got["probe"] == "the child's" and got["own_session"]
    assert got["title"][:3] == [sys.executable, "-m", PROBE]  # as `ps` shows it


def test_signals_and_deadlines_read_as_popens(zygote, tmp_path):
    proc, ours, _ = start(zygote, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.kill()  # after the exit: a no-op, never a signal to a reused pid


def test_what_the_zygote_cannot_serve_gets_a_real_popen(zygote, tmp_path):
    # A key read at import (vLLM's, the hub's) differs: the zygote imported
    # with its own value, so only a fresh interpreter is the same command.
    env = {**zygote.env, "VLLM_LOGGING_LEVEL": "DEBUG"}
    proc, ours, log = start(zygote, tmp_path, "0", env=env)
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(60) == 0
    assert not zygote.eligible(["taskset", "-c", "1", sys.executable, "-m", PROBE], zygote.env)
    cmd = [sys.executable, "-m", PROBE]
    # A key the zygote's own imports set (OpenCV sets LD_LIBRARY_PATH), set
    # the same by the caller's imports: a fresh interpreter would have it too.
    zygote.set_by_imports["LD_LIBRARY_PATH"] = "/cv2/lib64:"
    try:
        assert zygote.eligible(cmd, {**zygote.env, "LD_LIBRARY_PATH": "/cv2/lib64:"})
        assert not zygote.eligible(cmd, {**zygote.env, "LD_LIBRARY_PATH": "/elsewhere"})
    finally:
        del zygote.set_by_imports["LD_LIBRARY_PATH"]
    assert not zygote.eligible([sys.executable, "-m", "json.tool"], zygote.env)
