"""The session's rank pool (tests/rank_pool.py) runs a worker as torchrun
would: each job its own environment and output, on the same ranks; a job
that fails ends the pool, naming the rank's error, and the next job gets
ranks of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import processes
from tests.rank_pool import RankPool

WORKER = Path(__file__).with_name("pool_probe_worker.py")


@pytest.mark.e2e  # torchrun ranks: not in --fast
def test_jobs_share_the_ranks_but_not_their_environment_and_a_failure_ends_the_pool(tmp_path):
    pool = RankPool(tmp_path / "pool", nproc=2)
    try:
        def job(n: int, *flags: str, **env: str):
            out = tmp_path / f"{n}.json"
            proc = pool.run(WORKER, ["--out", str(out), *flags], timeout_s=120,
                            env=processes.repo_env(**env))
            return proc, json.loads(out.read_text()) if out.exists() else None

        proc, first = job(0, PROBE="set")
        assert proc.returncode == 0 and first["probe"] == "set", proc.stdout
        assert "rank 0 says hello" in proc.stdout and "rank 1 says hello" in proc.stdout
        _, second = job(1)
        assert second["pids"] == first["pids"]  # the same ranks: no launch
        assert second["probe"] is None  # the first job's variable went with it
        failed, _ = job(2, "--fail")
        assert failed.returncode == 1 and "rank 1 was told to fail" in failed.stdout
        assert pool.proc is None  # ended: a peer may be waiting in a collective
        proc, third = job(3)
        assert proc.returncode == 0 and set(third["pids"]).isdisjoint(first["pids"])
    finally:
        pool.close()
    assert pool.proc is None
