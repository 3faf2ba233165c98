"""Test servers forked from one interpreter that has imported them already.

Why: a test server's API process spends most of its start importing vLLM
and the server (measured: `vllm.engine.arg_utils` 6.4 CPU-s, ours 2.2,
`async_llm` 1.8), the same imports every time, and a CI run starts ~45 of
them on two cores. So the session starts one process that imports them once
(tests/server_zygote_process.py), and each eligible `launch_server` asks it
for a fork (`Zygote.popen`, in place of `subprocess.Popen`): the child sets
the environment, working directory, output and listening sockets it was
sent, then runs `python -m <module>`'s code as that command would have
(`runpy`), its engine core forked from it as test servers' are anyway.
Measured side by side (bench/engine_start.py): to ready, 0.24x the CPU.

Eligible: `[sys.executable, "-m", <a module the zygote serves>, ...]` with an
environment that differs from the zygote's only in `ROLLOUT_SIDECAR_*` keys
(read when the server starts, not when it is imported) or in keys the
zygote's own imports set, to the value they set. Anything else (a `VLLM_*`
or `HF_*` key read at import, a prefix such as `taskset` or `unshare`) gets
a real `subprocess.Popen`, and so do the servers whose tests prove the
product's own process layout (they differ in `VLLM_*` keys).

The child is a `ForkedProcess` to the caller: Popen's `pid`, `poll`, `wait`,
`send_signal`, `terminate`, `kill`, `returncode`. It is the zygote's child,
not the caller's, so the zygote reaps it and sends its exit status back over
the connection that asked for it.

Forking is safe here as it is for a server's own engine core: the zygote
only imports, so no thread of Python's runs and GNU OpenMP's pool has not
started (a pool started before a fork hangs the child's first parallel op:
docs/gpu.md finding 16); the threads the imports do start are OpenBLAS's
(numpy's, OpenCV's), which shut down and restart around a fork
(pthread_atfork). The zygote refuses to serve if a Python thread runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.server_zygote_process import MESSAGE_BYTES, POLL_S, env_file

# What a test server's API process imports before it forks its engine core.
SERVER_MODULE = "rollout_sidecar.server.cli"
PRELOAD = ("rollout_sidecar.server.serve", "rollout_sidecar.server.engine.engine_config",
           "rollout_sidecar.server.engine.lifecycle", "vllm.engine.arg_utils",
           "vllm.usage.usage_lib", "vllm.v1.engine.async_llm")
# Keys a server reads when it starts (its settings), so a child may differ in
# them; and pytest's, which only pytest reads.
RUNTIME_PREFIXES = ("ROLLOUT_SIDECAR_", "PYTEST_")
READY_TIMEOUT_S = 300


class ForkedProcess:
    """A process the zygote forked, handled as a `subprocess.Popen`."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.conn, self.pid, self.args = conn, pid, list(args)
        self.returncode: int | None = None
        self.cpu_s: float | None = None  # its CPU and its reaped children's, once it ended
        self.lock = threading.Lock()  # one reader of the connection at a time

    def _read(self, timeout: float | None) -> None:
        self.conn.settimeout(timeout)
        data = self.conn.recv(MESSAGE_BYTES)
        if not data:
            raise RuntimeError(f"the zygote went away before pid {self.pid} ended")
        ended = json.loads(data)
        self.returncode, self.cpu_s = ended["exit"], ended["cpu_s"]
        self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None and self.lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    with contextlib.suppress(BlockingIOError, TimeoutError):
                        self._read(0)
            finally:
                self.lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            if self.returncode is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._read(left)
                except (TimeoutError, BlockingIOError):
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        finally:
            self.lock.release()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid reused after the exit was reported
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The session's zygote, from the caller's side."""

    def __init__(self, folder: Path, env: Mapping[str, str],
                 modules: Sequence[str] = (SERVER_MODULE,),
                 preload: Sequence[str] = PRELOAD) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "zygote.sock"
        self.path.unlink(missing_ok=True)  # a last run's: ready() waits for this one's
        self.env = dict(env)
        self.modules = tuple(modules)
        self.log = folder / "zygote.log"
        self.up: bool | None = None  # None: not known yet
        self.set_by_imports: dict[str, str] = {}  # the zygote's environment its imports changed
        repo = str(Path(__file__).resolve().parents[1])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.server_zygote_process", str(self.path),
                 ",".join(self.modules), ",".join(preload)],
                env={**self.env, "PYTHONPATH": os.pathsep.join(
                    filter(None, [repo, self.env.get("PYTHONPATH")]))},
                stdout=out, stderr=subprocess.STDOUT, cwd=repo)

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Wait for its imports; False (and why, in its log) if it cannot serve."""
        deadline = time.monotonic() + timeout_s
        while self.up is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.up = False
            elif self.path.exists():
                self.set_by_imports = json.loads(env_file(self.path).read_text())
                self.up = True
            else:
                time.sleep(POLL_S)
        return self.up

    def eligible(self, cmd: Sequence[str], env: Mapping[str, str]) -> bool:
        """`python -m` of a module it serves, in an environment that differs
        from the zygote's only where a server reads it at run time, or where
        the zygote's own imports set a key (OpenCV's LD_LIBRARY_PATH, vLLM's
        TORCHINDUCTOR_*): the caller's imports set the same."""
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" \
                or cmd[2] not in self.modules:
            return False
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(RUNTIME_PREFIXES)
                   or (k in self.set_by_imports and env.get(k) == self.set_by_imports[k])
                   for k in differ)

    def popen(self, cmd: Sequence[str], *, env: Mapping[str, str], stdout: IO[Any],
              stderr: Any, start_new_session: bool = False,
              pass_fds: Sequence[int] = ()) -> ForkedProcess | subprocess.Popen:
        """A fork of the zygote running `cmd`, or `subprocess.Popen` if it is not eligible."""
        if stderr is subprocess.STDOUT and self.eligible(cmd, env) and self.ready():
            forked = self._fork(cmd, env, stdout.fileno(), start_new_session, pass_fds)
            if forked is not None:
                return forked
        return subprocess.Popen(list(cmd), env=dict(env), stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, pass_fds=pass_fds)

    def _fork(self, cmd: Sequence[str], env: Mapping[str, str], log_fd: int,
              new_session: bool, pass_fds: Sequence[int]) -> ForkedProcess | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(60)
            conn.connect(str(self.path))
            request = {"argv": list(cmd[3:]), "module": cmd[2], "env": dict(env),
                       "cwd": os.getcwd(), "new_session": new_session,
                       "pass_fds": list(pass_fds)}
            socket.send_fds(conn, [json.dumps(request).encode()], [log_fd, *pass_fds])
            reply = json.loads(conn.recv(MESSAGE_BYTES) or b'{"refused": "no reply"}')
        except OSError:
            conn.close()
            raise
        if "pid" not in reply:  # the zygote says why in its log; a plain start then
            conn.close()
            return None
        return ForkedProcess(conn, reply["pid"], cmd)

    def close(self) -> None:
        """Stop it (its children are the caller's to stop first)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
