"""Real pushes: torchrun (2 ranks, gloo) -> real server (vLLM CPU) -> /generate."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests import processes, rank_pool

WORKER = Path(__file__).with_name("push_worker.py")
pytestmark = pytest.mark.slow

# bf16 serving vs a transformers bf16 forward of the same weights, measured on
# the default model: mean |dlogp| 0.044, max 0.19. The pre-step weights are
# 0.33 mean away, so the bound below separates "pushed" from "not pushed".
MEAN_DLOGP_TOL = 0.1


def version(server) -> int:
    with server.client() as c:
        return c.info().weight_version


def run_worker(server, mode: str, v: int, tmp_path: Path, check: bool = True,
               env: dict | None = None, url: str | None = None
               ) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`url`: the replicas to push to (default: `server`, whose tokens are used)."""
    out = tmp_path / f"{mode}.json"
    args = ["--mode", mode, "--url", url or server.url, "--model", str(server.model_path),
            "--out", str(out), "--version", str(v)]
    # The worker shares the FSDP wrapping of tests/fidelity: the repo root on the path,
    # ahead of the caller's (which may point rollout_sidecar at this checkout).
    env = processes.repo_env(ROLLOUT_SIDECAR_ADMIN_TOKEN=server.admin_token,
                             ROLLOUT_SIDECAR_API_TOKEN=server.api_token, **(env or {}))
    if mode == "kill":  # a rank dies: ranks of its own, not the session's pool
        proc = processes.run(processes.torchrun(WORKER, args), env=env, timeout_s=600)
    else:
        proc = rank_pool.run(WORKER, args, env=env, timeout_s=600)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc, json.loads(out.read_text()) if out.exists() else None


def assert_pushed(report: dict, v_before: int) -> None:
    assert report["error"] is None
    assert report["version_before"] == v_before
    assert report["version_after"] == v_before + 1
    assert report["mean_abs_dlogp_bf16"] < MEAN_DLOGP_TOL, report
    # The served logprobs moved with the step: far from the old weights.
    assert report["mean_abs_dlogp_pre"] > 3 * report["mean_abs_dlogp_bf16"], report


# FSDP2 into this bf16 server is test_replicas' push (the same worker, mode
# fsdp2), and into bf16 families tests/fidelity's; fp32 proves it exact there.
@pytest.mark.parametrize("mode", ["fsdp1", "http", "split"])
def test_push_serves_the_stepped_weights(server, tmp_path, mode):
    v = version(server)
    _, report = run_worker(server, mode, v + 1, tmp_path)
    assert_pushed(report, v)
    # Both trainer ranks sent their share over gloo; HTTP is rank 0's alone.
    assert report["senders"] == (1 if mode == "http" else 2), report
    assert (report["senders_reason"] is None) == (mode != "http"), report
    assert report["check"] == "crc32"
    assert report["route"] == ("http" if mode == "http" else "chain"), report  # one replica
    assert report["own_rows"] == (mode == "split"), report  # FSDP2 sends its rows
    if mode == "split":  # a 0.1 MiB bucket: the embedding and lm_head went in chunks
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(report["split"]), report
        assert report["max_bucket_bytes"] <= int(0.1 * 2**20)


@pytest.mark.parametrize("mode, reason", [("bad_shape", "shape"), ("bad_checksum", "checksum"),
                                          ("rank1_fails", "trainer rank 1: sending bucket")])
def test_rejected_push_keeps_old_version(server, tmp_path, mode, reason):
    v = version(server)
    proc, report = run_worker(server, mode, v + 1, tmp_path)
    assert reason in (report["error"] or ""), (report, proc.stderr[-4000:])
    assert report["version_after"] == v  # the old weights kept serving
    status = httpx.get(server.url + "/weights/status",
                       headers={"Authorization": f"Bearer {server.admin_token}"}).json()
    assert status["weight_version"] == v and not status["push_in_progress"]


def test_killed_trainer_leaves_old_version_then_next_push_works(server, tmp_path):
    v = version(server)
    proc, _ = run_worker(server, "kill", v + 1, tmp_path, check=False)
    assert proc.returncode != 0
    with server.client() as c:
        r = c.generate(["still serving?"], sampling=dict(max_tokens=4))
    assert r.weight_version == v
    _, report = run_worker(server, "fsdp2", v + 1, tmp_path, env={"PUSH_KILLED_ONCE": "1"})
    assert_pushed(report, v)


def test_meta_device_module_is_refused_by_name(server, tmp_path):
    v = version(server)
    _, report = run_worker(server, "meta", v + 1, tmp_path)
    assert "meta device" in report["error"]
    assert "model.layers.1.mlp.up_proj" in report["error"]
    assert version(server) == v
