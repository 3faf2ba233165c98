"""`rollout-sidecar doctor`, for real: it starts the engine, pushes the
checkpoint once from a trainer of its own and probes it. On a healthy install
every step passes; when the server serves something else than what was pushed
(a stale layer, injected into the load) the probe step fails and names itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow
DEADLINE_S = 600


def doctor(tmp_path, fault: str = "") -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    failpoints = tmp_path / "fault"
    failpoints.write_text(fault)
    env = dict(os.environ, PYTHONFAULTHANDLER="1",
               ROLLOUT_SIDECAR_CACHE_DIR=os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE",
                                                        str(tmp_path / "cache")))
    proc = subprocess.Popen([sys.executable, "-m", "rollout_sidecar.server.cli", "doctor",
                             "--dtype", "float32", "--max-model-len", "512",
                             "--failpoints", str(failpoints)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"doctor ran past {DEADLINE_S}s:\n{out[-3000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_doctor_passes_on_a_healthy_install_and_names_the_step_that_fails(tmp_path):
    # Two independent runs (each its own server on free ports), side by side.
    with ThreadPoolExecutor(2) as pool:
        # The load keeps a stale layer: only the probe can see it, and it must.
        stale = pool.submit(doctor, tmp_path / "stale",
                            "load.stale:model.layers.0.mlp.down_proj.weight")
        ok = doctor(tmp_path / "healthy")
        bad = stale.result()
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    lines = ok.stdout.splitlines()
    for step in ("platform", "engine start", "weight routes", "push and probe"):
        assert any(ln.startswith(f"ok    {step}") for ln in lines), ok.stdout
    assert "gloo from cpu" in ok.stdout and "all checks passed" in ok.stdout
    print(ok.stdout)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert any(ln.startswith("FAIL  push and probe") for ln in bad.stdout.splitlines()), \
        bad.stdout
    assert "all checks passed" not in bad.stdout
    print(bad.stdout)
