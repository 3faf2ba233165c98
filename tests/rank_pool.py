"""Torchrun ranks kept between tests: a worker's body runs as a job, not a launch.

Why: one torchrun launch costs about 19 s of CPU before its body runs (the
agent and each rank import torch; each rank transformers and our trainer:
measured on a 2-core machine, 11.6 s and 19.1 CPU-s for a body that returns
at once), and the suite launched some seventy. A pool is launched once and
then runs one job after another: a `tests/rank_worker.py` worker (its
`arguments` and `body`), run as `rank_worker.main` runs it, on the same gloo
group. Its ranks are then what a user's trainer is: one process that pushes
again and again, through one pusher after another.

Both halves are here. The test side (`RankPool.run`) writes `job-N.json` in
the pool's folder and waits for each rank's `job-N.rankR.done`. Each rank
(this file run by torchrun) polls for the next job file itself, so an idle
pool holds no collective open; runs the job with its output in
`job-N.rankR.log` and the job's environment applied (then restored); and
writes its `done`: `0`, or its traceback.

A job that fails (a rank raises or its deadline passes) ends the pool, with
the stacks of every rank at a deadline (tests/processes.py); the next job
launches a new one. What a job cannot prove, a launch of its own still does:
a process's start and exit (tests/e2e/test_clean_exit.py), a rank that dies,
the frameworks' own launchers (TRL's accelerate, verl's and SkyRL's Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tests import processes

POLL_S = 0.05
STOP = "stop"


class RankPool:
    """`nproc` ranks under one torchrun, started on the first job."""

    def __init__(self, folder: Path, nproc: int) -> None:
        self.folder, self.nproc = folder, nproc
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.jobs = 0

    def run(self, worker: Path | str, args: Sequence[str], *, timeout_s: float,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """`worker`'s body with `args` on every rank, as `processes.run(
        processes.torchrun(worker, args))` would run it; `env` as there (the
        ranks' environment for this job)."""
        self._ensure_running()
        change = env_change(self.env, env)  # against the environment the ranks started with
        if "PYTHONPATH" in change["set"] or "PYTHONPATH" in change["unset"]:
            raise ValueError("a job cannot change PYTHONPATH (read once, at the ranks' start): "
                             "launch this worker with processes.torchrun")
        n, self.jobs = self.jobs, self.jobs + 1
        module = module_name(Path(worker))
        job = {"module": module, "argv": list(map(str, args)), **change}
        tmp = self.folder / f"job-{n}.tmp"
        tmp.write_text(json.dumps(job))
        tmp.rename(self.folder / f"job-{n}.json")
        cmd = [f"rank pool job {n}: {module}", *job["argv"]]
        deadline = time.monotonic() + timeout_s
        done = [self.folder / f"job-{n}.rank{r}.done" for r in range(self.nproc)]
        assert self.proc is not None
        while not all(d.exists() for d in done):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if all(d.exists() and d.read_text() == "0" for d in done):
            output = self._output(n)
            return subprocess.CompletedProcess(cmd, 0, output, output)
        if self.proc.poll() is None and time.monotonic() > deadline:
            tree = processes.describe_tree(self.proc)
            self._end()  # the ranks' stacks go to their job logs (faulthandler)
            output = self._output(n)
            raise processes.DeadlineExceeded(cmd, timeout_s, output=output,
                                             stderr=f"{tree}\n{output}")
        self._end()  # a rank failed: the others may wait in a collective forever
        output = self._output(n)
        return subprocess.CompletedProcess(cmd, 1, output, output)

    def close(self) -> None:
        """Ask the ranks to leave (their group ends as `rank_worker.main`'s
        does), then wait; a pool that does not leave in 60 s is ended."""
        if self.proc is None:
            return
        (self.folder / STOP).write_text("")
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self._end()
        self.proc = None

    def _ensure_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.iterdir():  # a pool that ended: its jobs are done with
            old.unlink()
        self.env = processes.repo_env()
        self.jobs = 0
        log = open(self.folder / "pool.log", "a")  # noqa: SIM115 - the pool's lifetime
        self.proc = subprocess.Popen(
            processes.torchrun(Path(__file__), ["--folder", str(self.folder),
                                                "--owner", str(os.getpid())], self.nproc),
            env=dict(self.env, PYTHONFAULTHANDLER="1"), stdout=log, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        log.close()

    def _end(self) -> None:
        if self.proc is not None:
            processes.end_tree(self.proc)
            self.proc = None

    def _output(self, n: int) -> str:
        """The torchrun agent's output (its tail), then each rank's of job `n`."""
        pool_log = self.folder / "pool.log"
        parts = [f"--- torchrun\n{pool_log.read_text(errors='replace')[-2000:]}"
                 if pool_log.exists() else "--- torchrun: no output"]
        for r in range(self.nproc):
            log = self.folder / f"job-{n}.rank{r}.log"
            text = log.read_text(errors="replace") if log.exists() else "(no output)"
            parts.append(f"--- rank {r}\n{text}")
        return "\n".join(parts)


# One pool at a time (each rank holds torch and transformers, ~0.5 GiB): a
# job for another rank count ends the one there is.
_pool: RankPool | None = None


def run(worker: Path | str, args: Sequence[str], *, timeout_s: float, nproc: int = 2,
        env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`processes.run(processes.torchrun(worker, args, nproc), ...)`, as a job
    of the session's pool of `nproc` ranks."""
    global _pool
    if _pool is not None and _pool.nproc != nproc:
        close()
    if _pool is None:
        _pool = RankPool(Path(tempfile.mkdtemp(prefix="rank-pool-")), nproc)
    return _pool.run(worker, args, timeout_s=timeout_s, env=env)


def close() -> None:
    """End the session's pool (tests/conftest.py, at the session's end)."""
    global _pool
    if _pool is not None:
        _pool.close()
        shutil.rmtree(_pool.folder, ignore_errors=True)
        _pool = None


def module_name(worker: Path) -> str:
    """`tests/e2e/push_worker.py` -> `tests.e2e.push_worker` (imported by
    name: the repository is on the ranks' path, as `repo_env` puts it)."""
    rel = worker.resolve().relative_to(processes.REPO).with_suffix("")
    return ".".join(rel.parts)


def env_change(base: Mapping[str, str], env: Mapping[str, str] | None) -> dict:
    """What a job's environment sets and unsets against the pool's."""
    if env is None:
        return {"set": {}, "unset": []}
    return {"set": {k: v for k, v in env.items() if base.get(k) != v},
            "unset": sorted(k for k in base if k not in env)}


# ------------------------------------------------------------------ a rank

@contextlib.contextmanager
def job_environment(job: dict) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in [*job["set"], *job["unset"]]}
    os.environ.update(job["set"])
    for k in job["unset"]:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """fds 1 and 2 (print, logging, faulthandler's dumps) into `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run_job(job: dict, rank: int) -> None:
    """One job, as `rank_worker.main` runs a worker launched for it."""
    from tests import rank_worker

    worker = importlib.import_module(job["module"])
    args = rank_worker.parse(getattr(worker, "arguments", None), job["argv"])
    rank_worker.run(worker.body, args, rank)


def serve(folder: Path, owner: int) -> None:
    """Jobs until the test side asks the ranks to leave, or is gone (a
    session killed before its end leaves no pool behind)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = 0
    while True:
        job_file = folder / f"job-{n}.json"
        if (folder / STOP).exists() or not alive(owner):
            break
        if not job_file.exists():
            time.sleep(POLL_S)
            continue
        job = json.loads(job_file.read_text())
        outcome = "0"
        with output_to(folder / f"job-{n}.rank{rank}.log"), job_environment(job):
            try:
                run_job(job, rank)
            except BaseException:  # noqa: BLE001 - reported, then this rank leaves
                outcome = traceback.format_exc()
                print(outcome, file=sys.stderr, flush=True)
        # Whole or not at all: the test side reads it as soon as it exists.
        done = folder / f"job-{n}.rank{rank}.done"
        done.with_suffix(".tmp").write_text(outcome)
        done.with_suffix(".tmp").rename(done)
        if outcome != "0":
            sys.exit(1)  # the test side ends the pool; a peer may be in a collective
        n += 1
    dist.barrier()
    dist.destroy_process_group()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--owner", type=int, required=True, help="the test session's pid")
    parsed = ap.parse_args()
    serve(parsed.folder, parsed.owner)
