"""Unit tests of the fidelity pieces that need no engine: the index's wire
dtypes, bucket planning with buffers, NaN on the wire, the checkpoint layout of
transformers MoE models, and the probe's tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout_sidecar.protocol.schema import GenerateResponse
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo, param_plan, persistent_buffers
from rollout_sidecar.trainer.pack.buckets import plan_buckets
from rollout_sidecar.trainer.probe import default_tolerance, drift_tolerance, probe_token_ids


def test_wide_tensors_in_a_narrow_checkpoint_keep_their_width():
    index = CheckpointIndex({
        "w": TensorSpec((1000, 1000), "bfloat16"),
        "router.e_score_correction_bias": TensorSpec((64,), "float32"),
        "tid2eid": TensorSpec((10, 2), "int64"),
    }, tie_word_embeddings=False)
    assert index.bulk_dtype == "bfloat16"
    assert index.push_dtype(index.tensors["w"], "bfloat16") == "bfloat16"
    # Kept fp32 on purpose by the checkpoint: rounding it can flip expert choices.
    assert index.push_dtype(index.tensors["router.e_score_correction_bias"], "bfloat16") \
        == "float32"
    assert index.push_dtype(index.tensors["tid2eid"], "bfloat16") == "int64"
    # Serving in fp32 widens everything floating.
    assert index.push_dtype(index.tensors["w"], "float32") == "float32"


def test_an_fp32_checkpoint_served_in_bf16_travels_in_bf16():
    index = CheckpointIndex({"w": TensorSpec((10, 10), "float32"),
                             "b": TensorSpec((10,), "float32")}, tie_word_embeddings=False)
    assert {index.push_dtype(t, "bfloat16") for t in index.tensors.values()} == {"bfloat16"}


def test_buckets_carry_per_tensor_wire_dtypes():
    params = [ParamInfo("w", (8, 8), torch.float32), ParamInfo("bias", (3,), torch.float32),
              ParamInfo("table", (4,), torch.int64)]
    (b,) = plan_buckets(params, torch.bfloat16, 1 << 20, wire={"bias": torch.float32})
    assert [(s.name, s.dtype, s.length) for s in b.params] == [
        ("w", "bfloat16", 128), ("bias", "float32", 12), ("table", "int64", 32)]


def test_persistent_buffers_join_the_plan_after_the_parameters():
    m = torch.nn.Linear(2, 2)
    m.register_buffer("kept", torch.zeros(3))
    m.register_buffer("scratch", torch.zeros(5), persistent=False)
    assert set(persistent_buffers(m)) == {"kept"}
    assert [p.name for p in param_plan(m, ["kept"])] == ["weight", "bias", "kept"]


def test_non_finite_logprobs_cross_the_wire_and_parse_back():
    body = {"results": [{"prompt_token_ids": [1], "samples": [
        {"text": "", "token_ids": [1, 2, 3], "logprobs": [-1.0, float("nan"), -math.inf],
         "finish_reason": "length"}]}], "weight_version": 0, "versions_used": [0],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
    wire = GenerateResponse.model_validate(body).model_dump_json()
    assert json.loads(wire)["results"][0]["samples"][0]["logprobs"] == [-1.0, "NaN",
                                                                        "-Infinity"]
    back = GenerateResponse.model_validate_json(wire).results[0].samples[0].logprobs
    assert back[0] == -1.0 and math.isnan(back[1]) and back[2] == -math.inf


def test_transformers_moe_experts_are_pushed_in_checkpoint_layout(tmp_path):
    """The fused in-memory experts map back to exactly what save_pretrained writes."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors
    from tests.fidelity.zoo import write_family

    path = write_family("qwen3-moe", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layout = CheckpointLayout(model)
    assert layout.active
    plan = layout.plan(param_plan(model))
    pushed = dict(layout.convert(iter_full_tensors(model)))
    assert [p.name for p in plan] == list(pushed)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(pushed) == set(on_disk) - tied
    for p in plan:
        assert tuple(on_disk[p.name].shape) == p.shape
        torch.testing.assert_close(pushed[p.name].to(torch.bfloat16), on_disk[p.name])


def test_models_without_conversions_pass_through():
    from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout

    m = torch.nn.Linear(2, 2)
    assert not CheckpointLayout(m).active


def test_probe_tokens_are_fixed_and_fit_the_model():
    ids = probe_token_ids(vocab_size=264, max_model_len=512)
    assert ids == probe_token_ids(264, 512) and len(ids) == 64
    assert all(0 <= t < 264 for t in ids)
    assert len(probe_token_ids(264, 20)) == 19


@pytest.mark.parametrize("serve, logits, tol", [
    (torch.float32, torch.float32, 1e-3), (torch.bfloat16, torch.float32, 0.1),
    (torch.float32, torch.bfloat16, 0.1), (torch.float16, torch.float32, 0.05)])
def test_probe_tolerance_follows_the_coarser_side(serve, logits, tol):
    assert default_tolerance(serve, logits) == tol


def test_drift_is_three_times_the_floor_or_the_margin_and_only_under_the_tolerance():
    assert drift_tolerance(0.1, None) is None  # the first probe: no floor yet
    assert drift_tolerance(0.1, 0.001) == pytest.approx(0.009)  # floor + 0.008
    assert drift_tolerance(0.1, 0.01) == pytest.approx(0.03)  # 3 x floor
    assert drift_tolerance(1e-3, 1e-7) is None  # fp32: the tolerance is tighter


class _Engine:
    """A fake engine (unit test): serves fixed logprobs under version 3."""

    def __init__(self, served: list[float]) -> None:
        from rollout_sidecar.server.engine.version_gate import VersionGate

        self.gate = VersionGate(3)
        self.served = served

    async def score(self, token_ids: list[int], version: int) -> list[float]:
        return self.served


@pytest.mark.parametrize("served, passed, drifted, suspect", [
    ([-1.0, -2.0], True, False, False),  # on the trainer's logprobs
    ([-1.02, -2.02], True, True, False),  # over the drift bound, within the tolerance
    ([-1.5, -2.5], False, False, True)])  # over the tolerance
def test_a_probe_over_its_drift_bound_passes_as_drift_and_is_never_suspect(
        served, passed, drifted, suspect):
    import asyncio

    from rollout_sidecar.protocol.schema import ProbeRequest
    from rollout_sidecar.server.metrics.collectors import ServerMetrics
    from rollout_sidecar.server.weights.probe_scoring import ProbeScorer

    metrics = ServerMetrics()
    engine = _Engine(served)
    req = ProbeRequest(version=3, token_ids=[5, 6, 7], trainer_logprobs=[-1.0, -2.0],
                       tolerance=0.1, drift_tolerance=0.01)
    result = asyncio.run(ProbeScorer(engine.gate, engine, metrics).probe(req))
    assert (result.passed, result.drifted) == (passed, drifted)
    assert (3 in engine.gate.suspect) == suspect
    outcome = "drifted" if drifted else "passed" if passed else "failed"
    assert metrics.registry.get_sample_value(
        "rollout_sidecar_weight_probes_total", {"outcome": outcome}) == 1
    with pytest.raises(ValueError, match="drift_tolerance"):
        ProbeRequest(version=3, token_ids=[5, 6], trainer_logprobs=[-1.0], tolerance=0.1,
                     drift_tolerance=0)
