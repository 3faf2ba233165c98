"""Every process a test starts runs under a deadline that leaves evidence.

`run()` is `subprocess.run` for tests: the child (and whatever it spawns)
gets `PYTHONFAULTHANDLER=1`, its own session, and a deadline. At the deadline
every process of its tree gets SIGABRT first, on which faulthandler prints
every thread's stack to the captured stderr, then SIGKILL, so a hang fails the
test with the stacks of each process and leaves nothing behind. The tree is
read before any signal: torchrun starts its ranks in sessions of their own
(torch.distributed.elastic's subprocess handler), which a process-group kill
would miss.

`torchrun()` builds a torchrun command whose rendezvous port is bound by the
agent itself (`127.0.0.1:0`): a port picked by `free_port()` and bound later
can be taken in between by whatever else runs on the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

# How long the processes get to print their stacks after SIGABRT.
DUMP_GRACE_S = 5.0
STDERR_TAIL_CHARS = 20_000


class DeadlineExceeded(subprocess.TimeoutExpired):
    """The process outlived its deadline; the message carries every thread's
    stack of every process in its tree (faulthandler's dump)."""

    def __str__(self) -> str:
        err = self.stderr or ""
        return (f"{' '.join(map(str, self.cmd))[:300]} passed its {self.timeout:.0f} s deadline; "
                f"stacks and stderr (tail):\n{err[-STDERR_TAIL_CHARS:]}\nstdout (tail):\n"
                f"{(self.output or '')[-3000:]}")


REPO = Path(__file__).resolve().parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (workers
    import `tests.*`, and this checkout's package ahead of the caller's), plus
    `extra`."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, PYTHONPATH=path, **extra)


def torchrun(worker: Path | str, args: Sequence[str] = (), nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run` on this machine, the agent picking its port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            # the ranks' MASTER_ADDR (else the host's FQDN, which may not resolve to loopback)
            "--local-addr", "127.0.0.1", str(worker),
            *map(str, args)]


def run(cmd: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` to completion (text output captured), or raise `DeadlineExceeded`
    after `timeout_s` with the stacks of its whole tree, which is gone by then."""
    full_env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    # Files, not pipes: a child that fills a pipe nobody reads would hang for
    # a reason of our making.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(list(cmd), env=full_env, cwd=cwd, stdout=out, stderr=err,
                                text=True, start_new_session=True)
        try:
            proc.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            tree = describe_tree(proc)
            end_tree(proc)
            timed_out = True
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise DeadlineExceeded(list(cmd), timeout_s, output=stdout,
                               stderr=f"{tree}\n{stderr}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


@contextlib.contextmanager
def background(cmd: Sequence[str], *, log: Path, deadline_s: float,
               env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` beside the test (its output in `log`). At `deadline_s` its tree
    is described and dumped into `log` (faulthandler) and killed, as in
    `run`; when the block ends it gets SIGTERM and 30 s to stop, then the same."""
    full_env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def expire() -> None:
        with open(log, "a") as out:
            out.write(f"\n{describe_tree(proc)}\n")
        end_tree(proc)

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield proc
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                expire()


def describe_tree(proc: subprocess.Popen) -> str:
    """At the deadline, before any signal: each process of the tree, its state
    (running, sleeping, stopped), CPU seconds and TCP connections, which tell a
    rank waiting on a peer that stopped from one retrying a port nobody holds."""
    lines = ["process tree at the deadline:"]
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return "process tree at the deadline: gone"
    for p in tree:
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                conns = [f"{c.laddr.port}->{c.raddr.port if c.raddr else '-'} {c.status}"
                         for c in p.net_connections("tcp")]
                lines.append(f"  pid {p.pid} ppid {p.ppid()} {p.status()} "
                             f"cpu {cpu.user + cpu.system:.1f}s {' '.join(p.cmdline())[:160]}"
                             f"\n    tcp: {', '.join(conns) or 'none'}")
        except (psutil.NoSuchProcess, psutil.AccessDenied) as e:
            lines.append(f"  pid {p.pid}: {type(e).__name__}")
    return "\n".join(lines)


def end_tree(proc: subprocess.Popen) -> None:
    """SIGABRT every process of `proc`'s tree (faulthandler dumps its stacks),
    then SIGKILL whatever is left, and reap `proc`."""
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    # One at a time, parents first: the dumps do not interleave, and a
    # torchrun agent cannot SIGTERM its ranks (no dump) on seeing one abort.
    for p in tree:
        _signal(p, signal.SIGABRT)
        with contextlib.suppress(psutil.TimeoutExpired):
            p.wait(DUMP_GRACE_S / max(1, len(tree)))
    deadline = time.monotonic() + DUMP_GRACE_S
    _, alive = psutil.wait_procs(tree, timeout=DUMP_GRACE_S)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=max(1.0, deadline - time.monotonic()))
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything it started in its own group since
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def in_spawned_process(target: Any, args: tuple = (), timeout_s: float = 300) -> Any:
    """`target(*args, out)` in a fresh spawned interpreter (nothing this one
    imported or patched), and the value it puts on `out`; killed at
    `timeout_s`, the test then failed by name."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{getattr(target, '__name__', target)} ran past {timeout_s:.0f} s")
    return out.get(timeout=5)
