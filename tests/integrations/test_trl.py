"""The real TRL 1.16 GRPOTrainer generating through a real server
(trainer/integrations/trl.py): a LoRA model pushed merged in one process, two
DDP processes, and TRL's own VLLMClient.generate. (accelerate's FSDP2 plugin
on CPU hands TRL a DDP model, so FSDP2 under TRL is not covered here yet.)

Each run (trl_worker.py, a subprocess: TRL and accelerate keep process-wide
state) trains 3 steps of 4 completions (of 8 tokens) per step on the default model
served in float32. Every run must show: every completion's weight_version is
the version pushed before it (and reached the reward function), the versions
count up one per push, every push's probe passed, no push went unread, and
TRL's log history holds the rewards and the versions. TRL's asynchronous
AsyncGRPOTrainer (trainer/integrations/trl_async.py) runs last, on the same
server (trl_async_worker.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.conftest import REPO, ServerSpec, free_port, server_fixture

WORKER = Path(__file__).with_name("trl_worker.py")
STEPS = 3
TEMPERATURE = 0.9
# Mean |served - trainer| sampled-token logprob, as TRL logs it
# (sampling/sampling_logp_difference/mean): float32 on both sides.
SAMPLING_GAP_TOL = 1e-3
pytestmark = pytest.mark.slow

# Processed logprobs: what TRL's importance-sampling correction compares with
# its own temperature-scaled ones (the runs sample at TEMPERATURE).
SERVER = ServerSpec.of("trl", dtype="float32",
                       env={"ROLLOUT_SIDECAR_LOGPROBS_MODE": "processed_logprobs"})


srv = server_fixture(SERVER)


def launch(mode: str, tmp: Path) -> list[str]:
    """The command that starts the worker's ranks."""
    if mode == "one":
        return [sys.executable, str(WORKER)]
    if mode == "ddp":  # torchrun's ranks; TrainingArguments(use_cpu) makes accelerate's state
        return processes.torchrun(WORKER)
    if mode == "fsdp2":  # accelerate's FSDP2 plugin: DDP on CPU (not in CI, see above)
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO / "examples/trl/fsdp2_cpu.yaml"), "--main_process_port",
                str(free_port()), str(WORKER)]
    raise ValueError(mode)


def worker_env(srv) -> dict[str, str]:
    """A worker's environment: the server and its tokens, one thread each."""
    return processes.repo_env(ROLLOUT_SIDECAR_URL=srv.url,
                              ROLLOUT_SIDECAR_API_TOKEN=srv.api_token,
                              ROLLOUT_SIDECAR_ADMIN_TOKEN=srv.admin_token,
                              OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def run(srv, tmp: Path, mode: str, *args: str) -> list[dict]:
    out = tmp / "out"
    env = worker_env(srv)
    cmd = [*launch(mode, tmp), "--model", str(srv.model_path), "--out", str(out),
           "--steps", str(STEPS), "--temperature", str(TEMPERATURE), *args]
    proc = processes.run(cmd, env=env, timeout_s=600)
    if proc.returncode != 0:
        raise AssertionError(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(reports) == reports[0]["world_size"]
    return reports


def check(reports: list[dict]) -> None:
    """The honesty checks every run must pass."""
    first = reports[0]
    pushes = first["pushes"]
    versions = [p["version"] for p in pushes]
    assert pushes and versions == list(range(versions[0], versions[0] + len(pushes))), pushes
    assert all(p["probe_passed"] for p in pushes), pushes
    for r in reports:
        assert r["global_step"] == STEPS
        # Every rank pushed together: the same steps and versions.
        assert [(p["step"], p["version"]) for p in r["pushes"]] == \
            [(p["step"], p["version"]) for p in pushes]
        assert r["generations"]
        for g in r["generations"]:
            pushed = [p["version"] for p in pushes if p["step"] <= g["step"]][-1]
            assert g["min_weight_version"] == pushed, (g, pushes)
            assert set(g["completion_versions"]) == {pushed}, (g, pushes)
        # The reward function received each completion's version.
        assert r["reward_versions"] == [v for g in r["generations"]
                                        for v in g["completion_versions"]]
    read = {v for r in reports for g in r["generations"] for v in g["completion_versions"]}
    assert set(versions) <= read, "a push no generation read"
    logs = [e for e in first["log_history"] if "reward" in e]
    assert len(logs) == len(first["generations"]), first["log_history"]
    assert all("sidecar/weight_version" in e for e in logs)
    # A step before the last push trained, so the pushes after it carried new
    # weights (Adam keeps moving them after a group whose rewards tied) and the
    # probe compared those with the trainer's.
    assert any(e["grad_norm"] > 0 for e in logs[:-1]), logs
    # TRL's importance-sampling correction ran on the served logprobs, and they
    # are the trainer's own temperature-scaled ones.
    assert all(r["logprobs_mode"] == "processed_logprobs" and r["use_vllm"] for r in reports)
    gaps = [e["sampling/sampling_logp_difference/mean"] for e in logs]
    assert max(gaps) < SAMPLING_GAP_TOL, gaps


def test_grpo_one_process_lora(srv, tmp_path):
    """A LoRA model (pushed merged) in one process; the plain model runs in
    the DDP and VLLMClient runs."""
    reports = run(srv, tmp_path, "one", "--peft")
    check(reports)
    assert reports[0]["model_type"] == "PeftModelForCausalLM"
    assert len(reports[0]["pushes"]) == STEPS  # a generation per step: a push per step


def test_vllm_client_generating_every_2_steps_pushes_only_what_is_read(srv, tmp_path):
    """TRL's VLLMClient.generate against /v1/completions, inside GRPOTrainer,
    generating every 2 optimizer steps: a push per generation, not per step."""
    reports = run(srv, tmp_path, "one", "--backend", "vllm_client",
                  "--steps-per-generation", "2", "--batch", "2")
    check(reports)
    assert [p["step"] for p in reports[0]["pushes"]] == [0, 2]


def test_grpo_two_processes_ddp(srv, tmp_path):
    reports = run(srv, tmp_path, "ddp", "--batch", "2")
    check(reports)
    assert all(r["wrapped_type"] == "DistributedDataParallel" for r in reports)


ASYNC_WORKER = Path(__file__).with_name("trl_async_worker.py")


def test_async_grpo_trains_on_pushed_weights_and_filters_by_the_spans(srv, tmp_path):
    """TRL's AsyncGRPOTrainer (trainer/integrations/trl_async.py): rollouts run
    in TRL's own spawned process while the trainer steps; every sync is a push
    through our data plane (commit policy keep) whose probe passes in float32,
    and every sample carries the oldest version of its spans, by which TRL's
    own `max_staleness` filter drops what fell too far behind."""
    out = tmp_path / "out"
    env = worker_env(srv)
    proc = processes.run([sys.executable, str(ASYNC_WORKER), "--model", str(srv.model_path),
                          "--out", str(out), "--steps", str(STEPS), "--max-staleness", "1"],
                         env=env, timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["global_step"] == STEPS
    pushes = report["pushes"]
    versions = [p["version"] for p in pushes]
    # One push before the first rollout, then one per step; versions go on
    # from what the server served, one per push.
    assert [p["step"] for p in pushes] == list(range(STEPS + 1)), pushes
    assert versions == list(range(versions[0], versions[0] + len(pushes))), pushes
    assert all(p["probe_passed"] for p in pushes), pushes  # served = trained, each push
    taken = report["taken"]
    assert taken and {t["version"] for t in taken} <= set(versions), taken
    stale = [t for t in taken if t["trainer_version"] - t["version"] > report["max_staleness"]]
    trained = [t for t in taken if t not in stale]
    # Rollouts went on while the trainer stepped: samples from pushed weights
    # after the first were trained on.
    assert any(t["version"] > versions[0] for t in trained), taken
    logs = [e for e in report["log_history"] if "loss" in e]
    assert len(logs) == STEPS and any(e["grad_norm"] > 0 for e in logs), logs
    # TRL's filter ran on our versions: it dropped exactly the samples whose
    # spans put them more than max_staleness behind.
    assert sum(e.get("sample/dropped_stale_total", 0) for e in logs) == len(stale), (logs, taken)
    assert max(e["sample/staleness_max"] for e in logs) <= report["max_staleness"]
