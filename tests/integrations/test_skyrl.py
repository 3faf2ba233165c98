"""SkyRL 0.4.0's own clients against a sidecar server (skyrl_worker.py):
generation through SkyRL's `RemoteInferenceClient` and the control calls
it makes; SkyRL's delta weight sync, its trainer engine as shipped, into
the sidecar's push (served exact to the bytes SkyRL ships); an update out
of order and SkyRL's NCCL transfer refused by name.

The server serves the tiny default model (a bf16 checkpoint) in fp32, its
generate routes open: SkyRL's generation client sends no bearer token. Its
weight client carries the admin token from a netrc file ($NETRC). SkyRL's
store lies under the server's --weight-sync-root.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.conftest import ServerSpec, server_fixture
from tests.integrations.frameworks import framework_env

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("skyrl_worker.py")


def sync_root(folder: Path) -> dict[str, str]:
    return {"ROLLOUT_SIDECAR_WEIGHT_SYNC_ROOT": str(folder / "store")}


SERVER = ServerSpec.of("skyrl", dtype="float32", env={"ROLLOUT_SIDECAR_API_TOKEN": ""},
                       prepare=sync_root)
srv = server_fixture(SERVER)


def test_skyrl_generates_and_syncs_weights_through_the_sidecar(srv, tmp_path):
    out = tmp_path / "skyrl.json"
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login skyrl password {srv.admin_token}\n")
    netrc.chmod(0o600)
    proc = processes.run([sys.executable, str(WORKER), "--url", srv.url,
                          "--model", str(srv.model_path), "--out", str(out),
                          "--work", str(srv.tmp / "store" / tmp_path.name)],
                         env=framework_env(NETRC=str(netrc),
                                           ROLLOUT_SIDECAR_ADMIN_TOKEN=srv.admin_token),
                         timeout_s=420)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(out.read_text())
    print("SKYRL", json.dumps(r))
    direct = r["direct"]
    assert r["response_ids"] == direct["ids"] and all(direct["ids"]), r
    for got, want in zip(r["response_logprobs"], direct["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-6), r
    assert set(r["stop_reasons"]) <= {"length", "stop"}, r
    assert r["calls"]["world_size"] == [1, 1], r

    one, two, reinit, over = r["delta"]  # SkyRL's delta sync: each step served exact
    assert (one["served_version"], two["served_version"]) == (1, 2), r["delta"]
    assert one["fp32_gap_max"] < 1e-4 and two["fp32_gap_max"] < 1e-4, r["delta"]
    assert one["scored"] != two["scored"]
    # After SkyRL's re-init, version 3 is version 2 plus its one change.
    assert reinit["served_version"] == 3 and reinit["fp32_gap_max"] < 1e-4, reinit
    assert over["refused"] and "starts again at 1" in over["refused"], over

    early, nccl = r["refusals"]["early"], r["refusals"]["nccl"]
    assert early[0] == 409 and "before /start_weight_update" in early[1], early
    assert nccl is not None and "NCCL weight transfer is not served" in nccl, nccl
