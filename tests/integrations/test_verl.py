"""verl 0.9.1 driving a sidecar server (trainer/integrations/verl/), with
verl's own code as far as it runs on CPU (verl has no CPU platform: its
trainer and actor workers need a GPU).

1. Weights (verl_push_worker.py, 2 FSDP2 ranks under torchrun): verl's
   `get_per_tensor_param` feeds our checkpoint engine, loaded from verl's
   registry, through the actor half of verl's sync sequence. The server
   serves a tiny Llama with a tied head and GQA, and a Qwen3-MoE (experts
   fused in transformers, unfused by verl), in fp32: after every push its
   logprobs are a transformers fp32 forward of torch's own state dict; a
   stream with a misnamed tensor fails on both ranks and changes nothing.
2. Rollouts (verl_rollout_worker.py, Ray on this machine): verl's
   `LLMServerManager`, load balancer, `LLMServerClient` and agent loop
   generate through our replica and Ray actor, configured by
   examples/verl/sidecar.yaml merged over verl's own ppo_trainer.yaml; the batch's tokens and
   logprobs are the server's own (the same prompt ids sent straight to it,
   greedy), and every sample carries the served version as verl's
   min/max global steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.conftest import ServerSpec, server_fixture, serves, stop_server
from tests.integrations.frameworks import framework_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
FP32_TOL = 1e-4
# A tied head with GQA; an MoE whose experts transformers fuses and verl's
# `unfuse_moe_params` splits back into the checkpoint's per-expert names.
FAMILIES = ["llama-tied-gqa", "qwen3-moe"]


def spec(family: str) -> ServerSpec:
    return ServerSpec(f"verl-{family}", dtype="float32", family=family)


srv = server_fixture(spec(FAMILIES[0]))


@pytest.fixture(scope="module", params=FAMILIES[1:])
@serves(spec)
def moe_srv(request, server_plan):
    s = server_plan.take(spec(request.param))
    yield s
    stop_server(s, wait=False)


def env(s) -> dict[str, str]:
    return framework_env(ROLLOUT_SIDECAR_URL=s.url, ROLLOUT_SIDECAR_ADMIN_TOKEN=s.admin_token,
                         ROLLOUT_SIDECAR_API_TOKEN=s.api_token)


def pushes(s, tmp_path: Path) -> list[dict]:
    out = tmp_path / "report.json"
    proc = processes.run(processes.torchrun(HERE / "verl_push_worker.py", [
        "--url", s.url, "--model", str(s.model_path), "--out", str(out)]),
        env=env(s), timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rounds = json.loads(out.read_text())["rounds"]
    for r in rounds:  # the closing note's table
        print("VERL", s.url, json.dumps({k: v for k, v in r.items() if k != "scored"}))
    return rounds


def test_verl_checkpoint_engine_pushes_an_moe_served_exact(moe_srv, tmp_path):
    rounds = pushes(moe_srv, tmp_path)
    for r in rounds[1:3] + rounds[4:]:
        assert r["error"] is None and r["fp32_gap_max"] < FP32_TOL, r
    assert [r["served_version"] for r in rounds] == [0, 1, 2, 2, 3], rounds
    assert "is not a tensor of the served model" in rounds[3]["error"], rounds[3]
    assert rounds[3]["scored"] == rounds[2]["scored"], "a refused push changed the weights"


def test_verl_checkpoint_engine_pushes_served_exact(srv, tmp_path):
    rounds = pushes(srv, tmp_path)
    zero, one, two, misnamed, rank0 = rounds

    assert zero["error"] is None and zero["metrics"]["sidecar/skipped"] == 1.0, zero
    assert zero["served_version"] == 0 and zero["fp32_gap_max"] < FP32_TOL, zero
    for r, v in ((one, 1), (two, 2)):
        assert r["error"] is None and r["served_version"] == v, r
        assert r["metrics"]["sidecar/weight_version"] == v, r
        assert r["metrics"]["sidecar/senders"] == 2, r  # both ranks hold every tensor
        assert r["fp32_gap_max"] < FP32_TOL, r
    assert two["metrics"]["sidecar/held_mb"] == 0, two  # the stream's order, learned
    assert one["scored"] != two["scored"]

    assert misnamed["error"] is not None and "'model.layers.0.mlp.up.weight' is not a " \
        "tensor of the served model" in misnamed["error"], misnamed
    assert misnamed["errors_by_rank"] == [True, True], misnamed
    assert misnamed["served_version"] == 2 and misnamed["scored"] == two["scored"], misnamed

    assert rank0["error"] is None and rank0["served_version"] == 3, rank0
    assert rank0["senders"] == 1 and "rank 0 alone" in rank0["senders_reason"], rank0
    assert rank0["fp32_gap_max"] < FP32_TOL, rank0
    assert rank0["probe_passed"] and rank0["probe_gap"] < 1e-5, rank0


def test_verl_agent_loop_generates_through_the_sidecar(srv, tmp_path):
    version = srv.client().info().weight_version
    out = tmp_path / "rollouts.json"
    proc = processes.run([sys.executable, str(HERE / "verl_rollout_worker.py"),
                          "--model", str(srv.model_path), "--out", str(out)],
                         env=env(srv), timeout_s=420)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    print("VERL-ROLLOUT", json.dumps(report))
    assert len(report["addresses"]) == 2 and len(set(report["addresses"])) == 2, report
    assert report["checkpoint"] == ["SidecarCheckpointManager", "SidecarCheckpointEngine"]

    one = report["one"]  # LLMServerClient.generate: verl's TokenOutput
    assert (one["tokens"], one["logprobs"]) == (one["direct"]["tokens"],
                                               one["direct"]["logprobs"]), one
    assert one["stop_reason"] == "completed", one
    fields = one["extra_fields"]
    assert fields["global_steps"] == fields["min_global_steps"] == \
        fields["max_global_steps"] == version, fields
    assert fields["weight_versions"] == [{"version": version, "start": 0,
                                          "end": len(one["tokens"]), "resumed": False}], fields

    for row in report["rows"]:  # the agent loop's padded batch
        assert row["tokens"] and row["tokens"] == row["direct"]["tokens"], row
        assert row["logprobs"] == pytest.approx(row["direct"]["logprobs"], abs=1e-6), row
        assert row["min_global_steps"] == row["max_global_steps"] == version, row
