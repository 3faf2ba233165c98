"""What happens to requests in flight when a push commits.

The push runs in this process: a plain (unsharded) transformers model pushed
over the HTTP transport, so its timing against the in-flight request is
predictable without torchrun.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


def push_during_long_request(server) -> tuple:
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    with server.client() as c:
        v = c.info().weight_version
    model = AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    box: dict = {}

    def long_request():
        with server.client(timeout=300) as c:
            box["r"] = c.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling=dict(
                n=16, max_tokens=500, seed=1))

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.5)  # the request is running in the engine
    pusher = WeightPusher(server.url, admin_token=server.admin_token, transport="http")
    result = pusher.push(model, version=v + 1)
    t.join(300)
    with server.client() as c:
        after = c.generate(["x"], sampling=dict(max_tokens=2))
    return v, box["r"], result, after


def push_with_policy(tmp_path, policy: str) -> tuple:
    # A server of its own: the session server must keep the checkpoint's weights
    # for the tests that compare against it.
    server = start_server(tmp_path, policy, {"ROLLOUT_SIDECAR_COMMIT_POLICY": policy})
    try:
        return push_during_long_request(server)
    finally:
        stop_server(server)


def test_wait_policy_finishes_in_flight_on_old_weights(tmp_path):
    v, in_flight, result, after = push_with_policy(tmp_path, "wait")
    assert result.version == v + 1
    assert in_flight.weight_versions == [v]
    assert all(s.finish_reason in ("stop", "length") for p in in_flight.results
               for s in p.samples)
    assert after.weight_version == v + 1


def test_abort_policy_aborts_in_flight(tmp_path):
    v, in_flight, result, after = push_with_policy(tmp_path, "abort")
    assert result.version == v + 1
    reasons = {s.finish_reason for p in in_flight.results for s in p.samples}
    assert "abort" in reasons
    assert in_flight.weight_version == v and after.weight_version == v + 1
