"""A replica that starts while its peers serve a newer version catches up
from one of them, without the trainer (server/weights/peer_copy.py).

Two fp32 replicas take five pushes from an in-process trainer; a third starts
with `--peers` naming them. Before it reports ready it serves version 5, and
its prompt logprobs equal the others' bit for bit (fp32: the same weights
give the same numbers) and a transformers forward of the trained weights to
the fp32 floor; then a push to all three commits everywhere. A replica with
nothing staged refuses to be read, naming why."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

TOKENS = [1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 200]
EXACT = 1e-4  # fp32 serving against a transformers fp32 forward (measured ~1e-7)


def status(server) -> dict:
    return httpx.get(server.url + "/weights/status", headers={
        "Authorization": f"Bearer {server.admin_token}"}, timeout=30).json()


def prompt_logprobs(server) -> torch.Tensor:
    r = httpx.post(server.url + "/generate", headers={
        "Authorization": f"Bearer {server.api_token}"}, json={
        "prompt_token_ids": [TOKENS], "sampling": {"max_tokens": 1, "prompt_logprobs": True}},
        timeout=60)
    r.raise_for_status()
    return torch.tensor(r.json()["results"][0]["prompt_logprobs"][1:], dtype=torch.float64)


def reference_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def step(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_a_late_replica_serves_the_fleets_version_before_it_is_ready(tmp_path):
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    servers = []
    try:
        a = start_server(tmp_path, "peer-a", dtype="float32")
        servers.append(a)
        b = start_server(tmp_path, "peer-b", dtype="float32", tokens_of=a)
        servers.append(b)
        # Nothing staged yet: nothing to read, and the reason says so.
        r = httpx.get(a.url + "/weights/staged",
                      headers={"Authorization": f"Bearer {a.admin_token}"}, timeout=30)
        assert r.status_code == 409 and "no complete version is staged" in r.text, r.text
        model = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32).eval()
        with WeightPusher([a.url, b.url], admin_token=a.admin_token, bucket_mb=1) as pusher:
            for v in range(1, 6):
                step(model, seed=v)
                assert pusher.push(model, version=v).version == v
        assert status(a)["weight_version"] == status(b)["weight_version"] == 5

        started = time.monotonic()
        c = start_server(tmp_path, "peer-c", dtype="float32", tokens_of=a,
                         extra_env={"ROLLOUT_SIDECAR_PEERS": f"{a.url},{b.url}"})
        servers.append(c)
        ready_s = time.monotonic() - started
        st = status(c)
        assert st["weight_version"] == 5, st
        timeline = st["catch_up"]
        assert timeline["outcome"] == "caught up" and timeline["version"] == 5, timeline
        assert timeline["peer"] in (a.url, b.url)
        print(f"\ncatch-up: start -> ready (serving v5) {ready_s:.1f}s; {timeline}")
        served = {s.url: prompt_logprobs(s) for s in servers}
        assert torch.equal(served[c.url], served[a.url]), (served[c.url] - served[a.url]).abs()
        assert torch.equal(served[c.url], served[b.url])
        gap = (served[c.url] - reference_logprobs(model)).abs().mean().item()
        assert gap < EXACT, gap
        assert st["delta_base"] == 5  # its staged copy holds v5: the next push may be a delta

        with WeightPusher([a.url, b.url, c.url], admin_token=a.admin_token,
                          bucket_mb=1) as pusher:
            step(model, seed=6)
            result = pusher.push(model, version=6)
        assert result.version == 6 and len(result.replicas) == 3
        assert all(status(s)["weight_version"] == 6 for s in servers)
        after = prompt_logprobs(c)
        assert (after - reference_logprobs(model)).abs().mean().item() < EXACT
        assert torch.equal(after, prompt_logprobs(a))
    finally:
        for s in servers:
            stop_server(s)
