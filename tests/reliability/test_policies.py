"""What a commit does to a request in flight, per push (`commit_policy` on the
pusher overrides the server's): `wait` lets it finish on the old weights,
`abort` ends it with finish_reason "abort" and the tokens so far. (The soak
proves the tags honest under load; this pins the per-request outcome.)"""

from __future__ import annotations

import threading

import pytest

from rollout_sidecar.trainer import WeightPusher
from tests.polling import engine_tokens, until_decoding
from tests.reliability.conftest import served_version

pytestmark = pytest.mark.slow


def push_during_long_request(server, trainer, policy: str, n: int, max_tokens: int) -> tuple:
    v = served_version(server)
    box: dict = {}
    tokens = engine_tokens(server)

    def long_request() -> None:
        with server.client(timeout=300) as c:
            box["r"] = c.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling=dict(
                n=n, max_tokens=max_tokens, seed=1))

    t = threading.Thread(target=long_request)
    t.start()
    until_decoding(server, tokens, "the long request decoding")
    assert t.is_alive(), "the request finished before the push: make it longer"
    pusher = WeightPusher(server.url, admin_token=server.admin_token, transport="http",
                          commit_policy=policy, probe=False)
    result = pusher.push(trainer.weights.load(v + 1), version=v + 1)
    t.join(300)
    with server.client() as c:
        after = c.generate(["x"], sampling=dict(max_tokens=2))
    return v, box["r"], result, after


def test_wait_finishes_in_flight_on_the_old_weights(reliable, trainer):
    v, in_flight, result, after = push_during_long_request(reliable, trainer, "wait", n=8,
                                                           max_tokens=200)
    assert result.version == v + 1 and result.commit_policy == "wait"
    assert in_flight.versions_used == [v]
    assert all(s.finish_reason in ("stop", "length") and len(s.token_ids) > 0
               for p in in_flight.results for s in p.samples)
    assert after.weight_version == v + 1


def test_abort_ends_in_flight_and_keeps_the_tokens_so_far(reliable, trainer):
    v, in_flight, result, after = push_during_long_request(reliable, trainer, "abort", n=16,
                                                           max_tokens=500)
    assert result.version == v + 1 and result.commit_policy == "abort"
    samples = [s for p in in_flight.results for s in p.samples]
    assert any(s.finish_reason == "abort" for s in samples)
    assert all(len(s.token_ids) == len(s.logprobs) for s in samples if s.logprobs)
    assert in_flight.versions_used == [v] and after.weight_version == v + 1
