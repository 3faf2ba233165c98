"""The one way to run `rollout-sidecar serve` as a subprocess: ports held from
the start (bound here and passed to it, so nothing takes them while its engine
starts), fresh tokens, its environment, a bounded wait for /ready (an error
that shows the log's tail) and a stop that escalates from SIGTERM to SIGKILL.

Used by the demo, the test fixtures and the benches. Light on purpose: it
imports neither vLLM nor torch (the server it starts does), only the standard
library and httpx.

    with launch_server(log=Path("server.log")) as server:
        GenerationClient(server.url, api_token=server.api_token).generate(...)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.protocol.schema.endpoints import auth_headers
from rollout_sidecar.server.listeners import PortUnavailable, bind_port, port_of

API_TOKEN_ENV = "ROLLOUT_SIDECAR_API_TOKEN"
ADMIN_TOKEN_ENV = "ROLLOUT_SIDECAR_ADMIN_TOKEN"
# No VLLM_CPU_KVCACHE_SPACE: `serve` sizes the KV cache to the model itself
# (server/engine/kv_cache_size.py); one in the environment or in `env` still wins.
# faulthandler in the server and its engine process: a crash, or the SIGABRT
# that `stop_process` sends one that ignored SIGTERM, prints every thread's
# stack to the log.
DEFAULT_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
STACK_DUMP_S = 5.0
LOG_TAIL_CHARS = 4000


class ChildProcess(Protocol):
    """What the launcher and its callers use of a started process:
    `subprocess.Popen`'s, which a test harness's fork also has (tests/server_zygote.py)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ServerStartError(RuntimeError):
    """The server exited, or was not ready in time; the message ends with its log."""


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A started `rollout-sidecar serve`. A context manager: stopped on exit."""

    url: str
    port: int
    data_plane_port: int
    api_token: str
    admin_token: str
    proc: ChildProcess
    log: Path
    env: dict[str, str] = field(repr=False)
    own_session: bool = False  # its own process group, killed whole by stop()
    failpoints: Path | None = None  # `serve --failpoints`: a server started for tests

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(log {self.log} unreadable: {e})"

    def is_ready(self) -> bool:
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(self.url + routes.READY.path, timeout=2,
                             verify=shared_tls()).status_code == 200
        return False

    def check_alive(self) -> None:
        """Raise `ServerStartError` (with the log's tail) if the process has exited."""
        if self.proc.poll() is not None:
            raise ServerStartError(f"server exited {self.proc.returncode} "
                                   f"(log {self.log}):\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 300, poll_s: float = 0.5) -> None:
        """Wait for GET /ready to answer 200; `ServerStartError` if the server
        exits first or is not ready within `timeout_s` (it is then stopped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.is_ready():
                return
            time.sleep(poll_s)
        self.stop(timeout_s=10)
        raise ServerStartError(f"server not ready after {timeout_s:.0f}s "
                               f"(log {self.log}):\n{self.log_tail()}")

    def info(self) -> dict[str, Any]:
        """GET /info (model, dtype, weight_version, ...)."""
        r = httpx.get(self.url + routes.INFO.path, timeout=30, headers=auth_headers(self.api_token),
                      verify=shared_tls())
        r.raise_for_status()
        return r.json()

    def stop(self, timeout_s: float = 60) -> int | None:
        """Stop it (see `stop_process`); returns the exit code."""
        return stop_process(self.proc, timeout_s, self.own_session)

    @contextlib.contextmanager
    def stopped_on_error(self) -> Iterator[ServerProcess]:
        """Stop the server if the block raises (a caller's setup after the start)."""
        try:
            yield self
        except BaseException:
            self.stop(timeout_s=10)
            raise

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process it spawned (the engine core, its helpers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def stop_process(proc: ChildProcess, timeout_s: float = 60,
                 own_session: bool = False) -> int | None:
    """SIGTERM (a server drains, then shuts its engine down); after
    `timeout_s`, SIGABRT (with PYTHONFAULTHANDLER, as `launch_server` sets it,
    the stuck process's stacks go to its log), then SIGKILL; with `own_session`
    (the process leads its group), whatever is left of the group (the engine
    core) is killed too. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STACK_DUMP_S)
            proc.kill()
    if own_session:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.returncode


def launch_server(*, log: Path, model: str | Path | None = None, dtype: str | None = None,
                  max_model_len: int | None = None, port: int | None = None,
                  data_plane_port: int | None = None, api_token: str | None = None,
                  admin_token: str | None = None, env: Mapping[str, str] | None = None,
                  args: Sequence[str] = (), host: str | None = None, cpus: str | None = None,
                  prefix: Sequence[str] = (), own_session: bool = False, wait: bool = True,
                  ready_timeout_s: float = 300, shm_size: str | None = None,
                  failpoints: Path | None = None,
                  popen: Callable[..., ChildProcess] = subprocess.Popen) -> ServerProcess:
    """Start `python -m rollout_sidecar.server.cli serve` with its output in `log`.

    Ports: free ones unless given, bound here and passed to the server as
    sockets (`--http-fd`, `--data-plane-fd`; not inside `prefix`). Tokens:
    `api_token`/`admin_token`, else the ones in `env`, else fresh random ones
    (an empty API token: none, the generate routes open); they reach the
    server through its environment only (never argv).
    Environment: this process's, then `DEFAULT_ENV` where unset, then `env`
    (which wins). `args`: more `serve` flags. `cpus` (a taskset list, e.g.
    "1") pins the server and its OpenMP threads; `prefix` runs it inside
    something (a network namespace), where it listens on every address and
    is reached at `host`. `own_session`: its
    own process group, so `stop()` also kills what it spawned. `wait`: block
    until /ready (else call `wait_ready()` later). `shm_size` (e.g. "256m";
    needs root): a /dev/shm of its own of that size (a tmpfs in a private
    mount namespace), as a container's `shm_size` gives it. `failpoints`:
    a file of failpoints to arm (`serve --failpoints`; tests only). `popen`:
    what starts the process, called as `subprocess.Popen` (tests fork it from
    a process that has imported the server, tests/server_zygote.py).
    """
    env = dict(env or {})
    # An empty API token: the generate routes open, for clients that send none
    # (SkyRL's RemoteInferenceClient), on a network of their own.
    open_api = api_token == "" or env.get(API_TOKEN_ENV) == ""
    api = "" if open_api else api_token or env.get(API_TOKEN_ENV) or secrets.token_hex(8)
    admin = admin_token or env.get(ADMIN_TOKEN_ENV) or secrets.token_hex(8)
    full_env = {**DEFAULT_ENV, **os.environ, **env, API_TOKEN_ENV: api, ADMIN_TOKEN_ENV: admin}
    if open_api:
        del full_env[API_TOKEN_ENV]
    if cpus is not None:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if host is not None:
        full_env["ROLLOUT_SIDECAR_HOST"] = "0.0.0.0"
    held: list[socket.socket] = []
    fds: list[str] = []
    if prefix:  # its own network namespace: nothing else binds there
        port = port or free_port()
        data_plane_port = data_plane_port or free_port()
    else:  # held from now on (listeners.py), passed to the server, closed here
        host_env = full_env.get("ROLLOUT_SIDECAR_HOST", "127.0.0.1")
        try:
            held.append(bind_port(host_env, port or 0, "port"))
            held.append(bind_port(full_env.get("ROLLOUT_SIDECAR_DATA_PLANE_HOST", host_env),
                                  data_plane_port or 0, "data_plane_port"))
        except PortUnavailable as e:
            for sock in held:
                sock.close()
            raise ServerStartError(f"{e.option}: {e}") from e
        port, data_plane_port = (port_of(sock) for sock in held)
        fds = ["--http-fd", str(held[0].fileno()), "--data-plane-fd", str(held[1].fileno())]
    if shm_size is not None:
        prefix = [*prefix, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                  'mount -t tmpfs -o "size=$0" tmpfs /dev/shm && exec "$@"', shm_size]
    cmd = [*prefix, *(["taskset", "-c", cpus] if cpus is not None else []),
           sys.executable, "-m", "rollout_sidecar.server.cli", "serve", "--port", str(port),
           "--data-plane-port", str(data_plane_port), *fds]
    cmd += ["--model", str(model)] if model is not None else []
    cmd += ["--dtype", dtype] if dtype is not None else []
    cmd += ["--max-model-len", str(max_model_len)] if max_model_len is not None else []
    cmd += ["--failpoints", str(failpoints)] if failpoints is not None else []
    cmd += list(args)
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log, "w") as out:
            proc = popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=own_session,
                                    pass_fds=[sock.fileno() for sock in held])
    finally:
        for sock in held:  # the server's copies hold the ports now
            sock.close()
    server = ServerProcess(f"http://{host or '127.0.0.1'}:{port}", port, data_plane_port, api,
                           admin, proc, log, full_env, own_session, failpoints)
    if wait:
        with server.stopped_on_error():
            server.wait_ready(ready_timeout_s)
    return server
