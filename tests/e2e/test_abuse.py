"""Hostile requests against a running server (bench/hostile_requests.py
makes them, and prints the before/after table in docs/security.md): each is
refused with the status it should get, the API process's memory does not
grow with what was sent, /health keeps answering, and the served weights do
not change. The ones that need servers of their own are elsewhere: an empty
token or failpoints in the environment (tests/test_auth_units.py, and
`serve` exiting here), a rogue peer (tests/e2e/test_catch_up.py), a SkyRL
re-init (tests/integrations/test_skyrl.py, against a transformers forward).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench import hostile_requests as hostile
from tests import processes
from tests.conftest import ServerSpec, server_fixture

pytestmark = pytest.mark.slow
GROWTH_MIB = 64  # what the API process may grow by, whatever was sent


def sync_root(folder: Path) -> dict[str, str]:
    return {"ROLLOUT_SIDECAR_WEIGHT_SYNC_ROOT": str(folder / "store")}


# It requires tagged buckets, as the chart's servers do.
srv = server_fixture(ServerSpec.of("abuse", dtype="float32", prepare=sync_root,
                                   env={"ROLLOUT_SIDECAR_REQUIRE_BUCKET_MACS": "true"}))


@pytest.fixture(scope="module")
def target(srv) -> hostile.Target:
    (srv.tmp / "store").mkdir(exist_ok=True)
    return hostile.Target(srv.url, srv.port, srv.dp_port, srv.api_token, srv.admin_token,
                          srv.proc.pid, srv.tmp / "store")


@pytest.mark.parametrize("scenario, status", [
    ("huge_body_no_token", "401 after"), ("huge_body_admin", "413 after"),
    ("huge_integers", "400"), ("vllm_rejects", "400,400,400,422"),
    ("oversized_manifest", "400"), ("oversized_bucket", "413 after"),
    ("store_flood", "refused"), ("zstd_bomb", "init 200, fetch 400"),
    ("sync_dir_escape", "400"),
])
def test_a_hostile_request_is_refused_without_growing_the_server(target, scenario, status):
    o = hostile.SHARED[scenario](target)
    print(o)
    assert o.status.startswith(status), o
    assert o.rss_peak_mib - o.rss_before_mib < GROWTH_MIB, o
    assert o.served == "unchanged", o
    assert "unfinished requests 0 -> 0" in o.note or scenario != "huge_integers", o
    if o.status.endswith("MiB sent"):  # refused at its first bytes, not after all of them
        assert int(o.status.split(" after ")[1].split()[0]) <= 16, o


@pytest.mark.parametrize("env, words", [
    ({"ROLLOUT_SIDECAR_ADMIN_TOKEN": ""}, "ROLLOUT_SIDECAR_ADMIN_TOKEN is set but empty"),
    ({"ROLLOUT_SIDECAR_ADMIN_TOKEN": "a b"}, "has white space"),
    ({"ROLLOUT_SIDECAR_ADMIN_TOKEN": "admin-0123456789", "ROLLOUT_SIDECAR_API_TOKEN": " "},
     "ROLLOUT_SIDECAR_API_TOKEN is set but empty"),
    ({"ROLLOUT_SIDECAR_ADMIN_TOKEN": "admin-0123456789",
      "ROLLOUT_SIDECAR_FAILPOINTS": "/tmp/x"}, "armed only by `serve --failpoints FILE`"),
])
def test_serve_refuses_to_start_on_an_open_door_naming_it(env, words):
    """Before any engine starts: exit 2, the variable named, how to fix it."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_SIDECAR_")}
    r = processes.run([sys.executable, "-m", "rollout_sidecar.server.cli", "serve"],
                      env={**full, **env, "COLUMNS": "300"}, timeout_s=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr, r.stderr


def test_a_server_that_requires_tagged_buckets_gets_them_from_a_plain_pusher(srv):
    """A connect without a secret is refused naming it; WeightPusher, with
    its defaults, reads `requires` from the status and tags every bucket,
    so its push lands (the server would refuse its connect otherwise)."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    admin = {"Authorization": f"Bearer {srv.admin_token}"}
    r = httpx.post(srv.url + "/weights/connect", headers=admin, timeout=60,
                   json={"connection_id": "no-secret"})
    assert r.status_code == 400 and r.json()["field"] == "secret", r.text
    status = httpx.get(srv.url + "/weights/status", headers=admin, timeout=30).json()
    assert status["requires"] == ["bucket_macs"], status
    model = AutoModelForCausalLM.from_pretrained(srv.model_path, dtype=torch.float32)
    with WeightPusher([srv.url], admin_token=srv.admin_token) as pusher:
        result = pusher.push(model, version=status["weight_version"] + 1)
    assert result.version == status["weight_version"] + 1, result
