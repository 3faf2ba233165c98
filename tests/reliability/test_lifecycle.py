"""The API contract under fuzzing, and a server's death and restart.

One small server (max_model_len 64, at most 8 sequences a request, so no
fuzzed request runs long): schemathesis over /openapi.json must find no 5xx
and no contract failure; then the server is SIGKILLed (its vLLM processes must
die with it) and restarted on the same ports, and long-lived pushers must
notice that it went back to its checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import torch

from rollout_sidecar.trainer import ServerRestartedError, WeightPusher
from tests import processes
from tests.conftest import ServerSpec, server_fixture, start_server
from tests.polling import port_free, until
from tests.server_plan import WORKER_PROCESS

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")
# WORKER_PROCESS: the orphans checked include vLLM's worker process.
SMALL = {**WORKER_PROCESS, "ROLLOUT_SIDECAR_MAX_SEQUENCES_PER_REQUEST": "8",
         "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "0.3",
         "ROLLOUT_SIDECAR_CONNECT_TIMEOUT_MAX_S": "0.3"}


SMALL_SERVER = ServerSpec.of("small", env=SMALL, max_model_len=64)


small = server_fixture(SMALL_SERVER)


def test_the_openapi_contract_holds_under_fuzzing(small):
    cli = Path(sys.executable).with_name("schemathesis")
    proc = processes.run(
        [str(cli), "--config-file", str(CONFIG), "run", f"{small.url}/openapi.json",
         "--checks", "all", "--max-examples", "50", "--seed", "1", "--no-color"],
        env=dict(os.environ, RS_API_TOKEN=small.api_token, RS_ADMIN_TOKEN=small.admin_token),
        timeout_s=800)
    summary = [ln for ln in proc.stdout.splitlines() if "generated" in ln or "passed" in ln]
    print("FUZZ", *summary[-2:])
    assert proc.returncode == 0, proc.stdout[-6000:]


def _model(server) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32)


def test_sigkill_leaves_no_orphans_and_pushers_notice_the_restart(small):
    model = _model(small)
    repush = WeightPusher(small.url, admin_token=small.admin_token, bucket_mb=1)
    strict = WeightPusher(small.url, admin_token=small.admin_token, transport="http",
                          on_server_restart="raise")
    assert strict.push(model, version=1).version == 1
    assert repush.push(model, version=2).version == 2 and not repush.push(
        model, version=3).server_restarted

    children = psutil.Process(small.proc.pid).children(recursive=True)
    assert children  # vLLM's engine core and worker
    small.proc.send_signal(signal.SIGKILL)
    small.proc.wait(60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert alive == [], f"orphaned after SIGKILL: {[p.pid for p in alive]}"

    until(lambda: port_free(small.port) and port_free(small.dp_port),
          "the killed server's ports free again")
    restarted = start_server(small.tmp, "small-restarted", extra_env=SMALL,
                             max_model_len=64, like=small)
    small.proc = restarted.proc  # the fixture stops whichever runs
    with pytest.raises(ServerRestartedError, match="restarted"):
        strict.push(model, version=4)
    result = repush.push(model, version=4)  # reconnects, pushes the trained weights again
    assert result.server_restarted and result.version == 4 and result.probe.passed
    assert not repush.push(model, version=5).server_restarted
