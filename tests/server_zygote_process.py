"""The test zygote's own process (tests/server_zygote.py is its caller's
side): import the server once, then fork a child per request, set up as
`subprocess.Popen` would have started it, and report each child's exit.

    python -m tests.server_zygote_process SOCKET MODULES PRELOAD

MODULES: the comma-separated modules it runs as `python -m` would; PRELOAD:
what it imports first. Its socket appears at SOCKET once the imports are
done, beside SOCKET.env.json: the environment keys its imports set.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

POLL_S = 0.2
MESSAGE_BYTES = 1 << 20


def env_file(path: Path | str) -> Path:
    """Where the zygote writes the environment keys its imports set."""
    return Path(f"{path}.env.json")


def _become(request: dict, fds: list[int], sockets: list[socket.socket],
            set_by_imports: Mapping[str, str]) -> None:
    """In the forked child: take the request's process state, then run its module."""
    for s in sockets:
        s.close()
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["new_session"]:
        os.setsid()
    # Out of the way of every target number first, then onto them (as
    # Popen's pass_fds: same numbers, inheritable).
    targets = request["pass_fds"]
    base = max([2, *targets]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds]
    for fd in fds:
        os.close(fd)
    log_fd, passed = moved[0], moved[1:]
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, target in zip(passed, targets, strict=True):
        os.dup2(fd, target)
    for fd in moved:
        os.close(fd)
    # The command as `ps` would show it; before the environment changes
    # (setproctitle takes over the memory after argv, where environ starts).
    title = [sys.executable, "-m", request["module"], *request["argv"]]
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(" ".join(title))
    os.chdir(request["cwd"])
    os.environ.clear()
    # What a fresh interpreter's imports would have set in its environment, as
    # the zygote's did (its subprocesses inherit it).
    os.environ.update({**set_by_imports, **request["env"]})
    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own descriptor, closed since
        return False
    return True


def _refuse(conn: socket.socket, why: str) -> None:
    print(f"zygote: refused: {why}", flush=True)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"refused": why}).encode())
    conn.close()


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                                      "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
            conn.close()


def _die_with_parent() -> None:
    """SIGTERM when the caller ends, however it ends (servers forked since
    do not inherit it: they are the caller's to stop)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _serve_request(listener: socket.socket) -> tuple[socket.socket, dict, list[int]] | None:
    """The next request, or None (a caller that left before it asked)."""
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 64)
        return conn, json.loads(msg), fds
    except (OSError, ValueError) as e:
        print(f"zygote: a caller left before its request: {e!r}", flush=True)
        conn.close()
        return None


def main(path: str, modules: str, preload: str) -> None:
    _die_with_parent()
    before = dict(os.environ)
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    served = set(modules.split(","))
    # Plugins loaded here would arm their fork hooks in every child (the
    # engine host's, vllm_plugin.py): the servers load them themselves.
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and getattr(plugins, "plugins_loaded", False):
        sys.exit("zygote: vLLM's plugins were loaded by an import; a fork would inherit them")
    if threading.active_count() != 1:
        sys.exit(f"zygote: threads {threading.enumerate()} after the imports; a fork would "
                 "leave their locks held in every child")
    # What the imports made lives as long as every child: out of their
    # collections (Python's gc docs advise it before forking; measured, two
    # starts each way: 4.3 CPU-s to ready against 5.9).
    gc.freeze()
    start_fds = {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(16)
    env_file(path).write_text(json.dumps(set_by_imports))
    os.rename(path + ".tmp", path)  # the caller waits for this name
    print(f"zygote: serving {sorted(served)} at {path}", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], POLL_S)
        _reap(children)
        if not readable:
            continue
        asked = _serve_request(listener)
        if asked is None:
            continue
        conn, request, fds = asked
        clash = set(request["pass_fds"]) & start_fds
        if request["module"] not in served or clash or len(fds) != 1 + len(request["pass_fds"]):
            for fd in fds:
                os.close(fd)
            _refuse(conn, f"module {request['module']}, fds {request['pass_fds']} "
                          f"(in use here: {sorted(clash)})")
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become(request, fds, [listener, conn, *children.values()], set_by_imports)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        conn.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    main(*sys.argv[1:4])
