"""POST /generate against a real vLLM CPU engine serving the default model."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from rollout_sidecar.client import SidecarError

# vLLM CPU (bf16) vs transformers (bf16) on the same checkpoint and tokens,
# measured: mean |dlogp| about 0.045, max about 0.2 (bf16 rounding of a
# near-uniform 264-way softmax). Mean is the asserted property.
MEAN_DLOGP_TOL = 0.1


def test_same_seed_same_output(server):
    with server.client() as c:
        a = c.generate(["abc", "xyz"], sampling=dict(n=3, max_tokens=16, seed=11))
        b = c.generate(["abc", "xyz"], sampling=dict(n=3, max_tokens=16, seed=11))
        other = c.generate(["abc", "xyz"], sampling=dict(n=3, max_tokens=16, seed=12))
    toks = lambda r: [[s.token_ids for s in p.samples] for p in r.results]  # noqa: E731
    assert toks(a) == toks(b)
    assert toks(a) != toks(other)
    assert [len(p.samples) for p in a.results] == [3, 3]


def test_seeded_prompts_past_the_step_budget_are_served(server):
    """Seeded prompts that together exceed a step's token budget (2048 on
    CPU): vLLM prefills one of them in parts, then rewinds its generator,
    which a CPU generator cannot do; the engine died with every request in
    flight (server/engine/seeded_prefill.py)."""
    # Twelve distinct prompts of 440 tokens (no prefix shared): a step takes
    # four whole and part of a fifth. Ids below the default model's vocab (264).
    prompts = [[5 + (37 * i + j) % 250 for j in range(440)] for i in range(12)]
    with server.client() as c:
        out = c.generate(prompt_token_ids=prompts,
                         sampling=dict(max_tokens=4, seed=7, temperature=1.0))
        assert [len(p.samples[0].token_ids) for p in out.results] == [4] * 12
        again = c.generate(["abc"], sampling=dict(max_tokens=4, seed=7))  # the engine lives
        assert len(again.results[0].samples[0].token_ids) == 4


def test_every_token_has_a_logprob_matching_transformers(server):
    from transformers import AutoModelForCausalLM

    with server.client() as c:
        r = c.generate(prompt_token_ids=[[104, 105, 32], [7, 8, 9, 10]],
                       sampling=dict(n=2, max_tokens=20, seed=3))
    assert r.versions_used == [r.weight_version]
    model = AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.bfloat16)
    deltas = []
    for p in r.results:
        for s in p.samples:
            assert len(s.logprobs) == len(s.token_ids) > 0
            assert s.finish_reason in ("stop", "length")
            ids = torch.tensor([p.prompt_token_ids + s.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits[len(p.prompt_token_ids) - 1:-1], -1)
            ref = lp.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            deltas += (ref - torch.tensor(s.logprobs)).abs().tolist()
    assert sum(deltas) / len(deltas) < MEAN_DLOGP_TOL


def test_usage_and_version_fields(server):
    with server.client() as c:
        r = c.generate(["hello"], sampling=dict(n=2, max_tokens=5))
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in r.results[0].samples)
    assert r.usage.prompt_tokens == 5
    assert isinstance(r.weight_version, int)


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def post(server, body, token=None):
    return httpx.post(server.url + "/generate", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {token or server.api_token}"})


@pytest.mark.parametrize("body, field", [
    ({"prompts": "not a list"}, "prompts"),
    ({"prompts": ["a"], "sampling": {"max_token": 3}}, "sampling.max_token"),
    ({"prompts": ["a"], "sampling": {"temperature": "hot"}}, "sampling.temperature"),
    ({}, None),
])
def test_malformed_body_is_422_naming_the_field(server, body, field):
    r = post(server, body)
    assert r.status_code == 422
    if field:
        assert r.json()["field"] == field


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": -1}, "sampling.temperature"),
    ({"top_p": 0}, "sampling.top_p"),
    ({"n": 0}, "sampling.n"),
    ({"max_tokens": 0}, "sampling.max_tokens"),
])
def test_out_of_range_sampling_is_400(server, sampling, field):
    r = post(server, {"prompts": ["a"], "sampling": sampling})
    assert r.status_code == 400
    assert r.json()["field"] == field


def test_prompt_longer_than_max_model_len_is_400(server):
    r = post(server, {"prompt_token_ids": [[1] * 600]})
    assert r.status_code == 400
    assert "max_model_len" in r.json()["error"]


def test_generate_token_is_required_and_admin_token_is_separate(server):
    assert post(server, {"prompts": ["a"]}, token="wrong").status_code == 401
    # The generate token cannot push weights.
    r = httpx.get(server.url + "/weights/status",
                  headers={"Authorization": f"Bearer {server.api_token}"})
    assert r.status_code == 401


def test_min_weight_version_in_the_future_is_409(server):
    with server.client() as c:
        v = c.info().weight_version
        with pytest.raises(SidecarError) as e:
            # The server waits min_version_wait_s (3s in tests), then answers 409.
            c.generate(["a"], sampling=dict(max_tokens=2), min_weight_version=v + 1000)
    assert e.value.status == 409
    assert e.value.field == "min_weight_version"


def test_health_ready_info(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    with server.client() as c:
        info = c.info()
    from safetensors import safe_open

    with safe_open(str(server.model_path / "model.safetensors"), "pt") as f:
        numel = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert info.max_model_len == 512 and info.num_parameters == numel


def _metrics(server) -> dict[str, float]:
    """/metrics through a Prometheus text parser: sample name -> sum over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_metrics_serve_ours_and_vllms_own(server):
    before = _metrics(server)
    for name in ("rollout_sidecar_requests_total", "rollout_sidecar_weight_version",
                 "rollout_sidecar_requests_running", "rollout_sidecar_requests_gated",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds_count"):
        assert name in before, name
    with server.client() as c:
        c.generate(["count me"], sampling=dict(max_tokens=5, seed=3))
    deadline = time.monotonic() + 10  # vLLM records after the output is handed over
    while True:
        after = _metrics(server)
        done = (after["vllm:generation_tokens_total"]
                >= before["vllm:generation_tokens_total"] + 5)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done, (before["vllm:generation_tokens_total"], after["vllm:generation_tokens_total"])
    assert (after["rollout_sidecar_generated_tokens_total"]
            >= before["rollout_sidecar_generated_tokens_total"] + 5)


def test_score_returns_prompt_logprobs_of_the_served_weights(server):
    """prompt_logprobs score given tokens; re-scoring sampled tokens gives back
    the logprobs they were sampled with (same weights, same engine)."""
    with server.client() as c:
        g = c.generate(prompt_token_ids=[[104, 105, 32]], sampling=dict(
            n=3, max_tokens=16, seed=5))
        seqs = [g.results[0].prompt_token_ids + s.token_ids for s in g.results[0].samples]
        scored = c.score(seqs, min_weight_version=g.weight_version)
    assert scored.weight_version == g.weight_version
    deltas = []
    for smp, res in zip(g.results[0].samples, scored.results, strict=True):
        assert res.prompt_logprobs[0] is None  # nothing precedes the first token
        assert len(res.prompt_logprobs) == len(res.prompt_token_ids)
        deltas += [abs(a - b) for a, b in zip(res.prompt_logprobs[3:], smp.logprobs,
                                              strict=True)]
    # bf16 prefill (scoring) vs decode (sampling) kernels round differently.
    assert sum(deltas) / len(deltas) < 0.02, deltas
    r = post(server, {"prompt_token_ids": [[1, 2]], "sampling": {"prompt_logprobs": True}})
    assert r.status_code == 200 and r.json()["results"][0]["prompt_logprobs"][0] is None
