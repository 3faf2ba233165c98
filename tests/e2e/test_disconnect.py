"""A clean `WeightPusher.close()` releases the data plane at once, and the
server setting `logprobs_mode`, against one real float32 server started with
`--logprobs-mode processed_logprobs` and a lease that never runs out within
the module (so any wait for it would show as a refusal: `lease_wait_s=0`).

Tests run in file order: the logprobs test reads the weights the push test
served.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from rollout_sidecar.trainer import WeightPusher
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from rollout_sidecar.trainer.errors import WeightPushError
from tests.conftest import ServerSpec, server_fixture

# fp32 serving vs a transformers fp32 forward of the same weights.
FP32_TOL = 1e-4
TEMPERATURE = 0.7


SERVER = ServerSpec.of("disconnect", dtype="float32",
                       env={"ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "3600",
                            "ROLLOUT_SIDECAR_LOGPROBS_MODE": "processed_logprobs"})


srv = server_fixture(SERVER)


@pytest.fixture(scope="module")
def model(srv):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(srv.model_path, dtype=torch.float32).eval()
    return m


def weight_status(srv) -> dict:
    r = httpx.get(srv.url + "/weights/status",
                  headers={"Authorization": f"Bearer {srv.admin_token}"})
    r.raise_for_status()
    return r.json()


def step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def pusher(srv, **kw) -> WeightPusher:
    return WeightPusher(srv.url, admin_token=srv.admin_token, bucket_mb=4,
                        probe_tolerance=FP32_TOL, **kw)


def test_info_reports_logprobs_mode(srv):
    with srv.client() as c:
        assert c.info().logprobs_mode == "processed_logprobs"


def test_a_closed_pusher_releases_the_data_plane_at_once(srv, model, capsys):
    v = weight_status(srv)["weight_version"]
    first = pusher(srv)
    step(model, 1)
    r1 = first.push(model, version=v + 1)
    # processed_logprobs leaves prompt logprobs raw: the probe stays exact in fp32.
    assert r1.probe is not None and r1.probe.passed, r1.probe
    assert weight_status(srv)["connected"] == first.transport.connection_id
    first.close()
    assert weight_status(srv)["connected"] is None

    # Another trainer within the (hour-long) lease: no wait allowed, none needed.
    with pusher(srv, lease_wait_s=0) as second:
        assert second.transport.trainer_id != first.transport.trainer_id
        step(model, 2)
        r2 = second.push(model, version=v + 2)
        assert r2.version == v + 2 and r2.probe.passed, r2.probe
        held = second.transport.connection_id
        assert weight_status(srv)["connected"] == held
        # Control: a pusher not yet closed keeps its lease, and a third trainer
        # that may not wait is refused at once.
        admin = WeightAdminClient(srv.url, srv.admin_token)
        with pytest.raises(WeightPushError, match="another trainer is pushing"):
            admin.connect("third", "gloo", 10.0, lease_wait_s=0, trainer_id="third")
        admin.close()
    assert weight_status(srv)["connected"] is None
    with capsys.disabled():
        print(f"\nbegin_s: first pusher {r1.timings['begin_s']:.2f}, second after close "
              f"{r2.timings['begin_s']:.2f}; probe mean |dlogp| {r1.probe.mean_abs_dlogp:.2g},"
              f" {r2.probe.mean_abs_dlogp:.2g}")


def test_processed_logprobs_are_the_tempered_distribution_trl_compares_with(srv, model):
    prompt = list(range(10, 26))
    with srv.client() as c:
        v = c.info().weight_version
        s = c.generate(prompt_token_ids=[prompt], min_weight_version=v, sampling={
            "max_tokens": 12, "temperature": TEMPERATURE, "seed": 3, "logprobs": True,
        }).results[0].samples[0]
        raw = c.score([prompt + s.token_ids], min_weight_version=v).results[0].prompt_logprobs
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + s.token_ids])).logits[0].float()
    picked = torch.tensor(s.token_ids)[:, None]
    rows = logits[len(prompt) - 1:-1]
    tempered = torch.log_softmax(rows / TEMPERATURE, -1).gather(-1, picked)[:, 0]
    served = torch.tensor(s.logprobs)
    # TRL's GRPO: log_softmax(logits / temperature) of the sampled tokens.
    assert (served - tempered).abs().mean() < FP32_TOL
    # Scoring (prompt logprobs) stays raw, and raw is far from tempered here.
    plain = torch.log_softmax(rows, -1).gather(-1, picked)[:, 0]
    assert (torch.tensor(raw[len(prompt):]) - plain).abs().mean() < FP32_TOL
    assert (served - plain).abs().mean() > 100 * FP32_TOL

    # The /v1 routes sample through the same engine: processed logprobs too.
    r = httpx.post(srv.url + "/v1/completions", headers={
        "Authorization": f"Bearer {srv.api_token}"}, json={
        "model": "", "prompt": prompt, "max_tokens": 4, "temperature": TEMPERATURE,
        "seed": 3, "logprobs": 0, "return_token_ids": True}, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    tempered = torch.log_softmax(logits[len(prompt) - 1:-1] / TEMPERATURE, -1).gather(
        -1, torch.tensor(ids)[:, None])[:, 0]
    assert (torch.tensor(lps) - tempered).abs().mean() < FP32_TOL
