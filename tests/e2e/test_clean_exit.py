"""A script that pushes and returns exits 0, every time (issue 26).

Each wrapper (a plain single process, FSDP2 and FSDP1 under torchrun with 2
gloo ranks) pushes once and returns, `RUNS` times (FSDP1, which aborted 2
runs of 8 before the fix, gets the most; the rest share its code): half call
`WeightPusher.close()`, half leave it to the pusher's own hook. Before the
fix, a rank that returned right after a push aborted in interpreter teardown
now and then (SIGABRT, "terminate called without an active exception": a gloo
worker thread still releasing a collective's tensor; trainer/collectives.py),
so a failure here is rare by nature: every run counts, and each failed one is
reported with its stderr. After each run the server must have let go of the
run's data-plane connection (close() or the hook, not a lease running out).

Two runs overlap: the next one starts (imports, builds its model) while the
last one pushes and exits, and pushes once that one has (exit_worker.py,
`--after`). Most of a run is interpreter and torchrun start-up, which this
hides behind the other run's server round trips.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests import processes
from tests.conftest import REPO

WORKER = Path(__file__).with_name("exit_worker.py")
# FSDP1 aborted about one run in four before the fix: 12 runs miss that with
# odds of 3%. FSDP2 never aborted (0 of 8 before the fix); it and the plain
# process share FSDP1's exit path: one run with close() and one without. The
# issue's 20 runs per wrapper: ROLLOUT_SIDECAR_EXIT_RUNS=20.
RUNS = {"plain": 2, "fsdp2": 2, "fsdp1": 12}
if os.environ.get("ROLLOUT_SIDECAR_EXIT_RUNS"):
    RUNS = dict.fromkeys(RUNS, int(os.environ["ROLLOUT_SIDECAR_EXIT_RUNS"]))
LANES = 2
RUN_TIMEOUT_S = 180
pytestmark = pytest.mark.slow


def weight_status(server) -> dict:
    return httpx.get(server.url + "/weights/status", timeout=30,
                     headers={"Authorization": f"Bearer {server.admin_token}"}).json()


@pytest.mark.parametrize("wrapper", ["plain", "fsdp2", "fsdp1"])
def test_a_push_script_exits_0_with_or_without_close(server, wrapper, tmp_path):
    runs = RUNS[wrapper]
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=path,
               ROLLOUT_SIDECAR_ADMIN_TOKEN=server.admin_token,
               ROLLOUT_SIDECAR_API_TOKEN=server.api_token)
    pushed = [tmp_path / f"pushed-{i}" for i in range(runs)]
    v0 = weight_status(server)["weight_version"]

    def run(i: int) -> str | None:
        """Run `i`; what went wrong, if anything."""
        how = "close()" if i % 2 == 0 else "no close()"
        args = ["--url", server.url, "--model", str(server.model_path), "--wrapper", wrapper,
                "--pushed", str(pushed[i]), *(["--after", str(pushed[i - 1])] if i else []),
                *(["--close"] if i % 2 == 0 else [])]
        cmd = [sys.executable, str(WORKER), *args] if wrapper == "plain" \
            else processes.torchrun(WORKER, args)
        try:
            proc = processes.run(cmd, timeout_s=RUN_TIMEOUT_S, env=env)
        finally:
            pushed[i].touch()  # the next run goes ahead whatever happened to this one
        if proc.returncode != 0:
            return f"run {i} ({how}): exit {proc.returncode}\n{proc.stderr[-3000:]}"
        conn = pushed[i].read_text()
        if conn and weight_status(server)["connected"] == conn:
            return f"run {i} ({how}): exit 0, but the server still holds its connection {conn}"
        return None

    with ThreadPoolExecutor(LANES) as lanes:
        failed = [f for f in lanes.map(run, range(runs)) if f is not None]
    assert not failed, f"{len(failed)} of {runs} {wrapper} runs failed:\n" + "\n\n".join(failed)
    assert weight_status(server)["weight_version"] == v0 + runs  # every run pushed
