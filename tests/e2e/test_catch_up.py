"""A replica that starts while its peers serve a newer version catches up
from one of them, without the trainer (server/weights/peer_copy.py).

Two fp32 replicas take five pushes from an in-process trainer; a third starts
with `--peers` naming them. Before it reports ready it serves version 5, and
its prompt logprobs equal the others' bit for bit (fp32: the same weights
give the same numbers) and a transformers forward of the trained weights to
the fp32 floor; then a push to all three commits everywhere. A fourth
replica's catch-up is held with every bucket staged (the `catch_up.hold`
failpoint) while a trainer pushes to all four: the push waits for it on that
replica, the replica commits the fleet's version first, then the push's,
and serves it bit for bit like the others; generation is refused there
until then. A fifth replica whose catch-up fails while its peers serve
version 7 stays not ready, saying why, until a push commits on it. A
replica with nothing staged
refuses to be read, naming why. A stub listed first among the peers, which
claims version 10^12 and answers the challenge without the token, is
refused by name and never sees the admin token."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time

import httpx
import pytest
import torch

from bench.rogue_peer import RogueStub
from rollout_sidecar.server.launcher import launch_server
from tests.conftest import ServerSpec, serves, start_server, stop_server
from tests.polling import until
from tests.server_plan import TEST_ENV, cache_dir

pytestmark = pytest.mark.slow
# The first two replicas come from the plan (started beside the tests before
# this one), with one fleet's tokens; the late ones start in the test.
FLEET = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
         "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8)}
PEER_A = ServerSpec.of("peer-a", dtype="float32", env=FLEET)
PEER_B = ServerSpec.of("peer-b", dtype="float32", env=FLEET)

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


@pytest.fixture
@serves(PEER_A, PEER_B)
def peers(server_plan):
    return server_plan.take(PEER_A), server_plan.take(PEER_B)


def test_a_late_replica_serves_the_fleets_version_before_it_is_ready(peers, tmp_path):
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    a, b = peers
    servers = [a, b]
    try:
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

        # Listed first: a stub serving zeros as version 10^12, without the token.
        index = httpx.get(a.url + "/weights/index", timeout=30,
                          headers={"Authorization": f"Bearer {a.admin_token}"}).json()
        rogue = RogueStub.serve(status(a), index)
        started = time.monotonic()
        try:
            c = start_server(tmp_path, "peer-c", dtype="float32", tokens_of=a, extra_env={
                "ROLLOUT_SIDECAR_PEERS": f"{rogue.url},{a.url},{b.url}"})
        finally:
            rogue.close()
        servers.append(c)
        ready_s = time.monotonic() - started
        st = status(c)
        assert st["weight_version"] == 5, st
        timeline = st["catch_up"]
        assert timeline["outcome"] == "caught up" and timeline["version"] == 5, timeline
        assert timeline["peer"] in (a.url, b.url)
        assert "did not prove it holds this fleet's admin token" in timeline["refused"][rogue.url]
        assert rogue.seen and not any(a.admin_token in json.dumps(h) for h in rogue.seen)
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

        push_during_a_catch_up(tmp_path, servers, model)
    finally:
        for s in servers:
            stop_server(s, wait=False)


def push_during_a_catch_up(tmp_path, servers, model) -> None:
    """Replica d's catch-up (of version 6) holds, every bucket staged, until
    the test releases it; a push of version 7 to all four starts meanwhile.
    On d the trainer's connect waits for the catch-up (d says so in its
    status), then the push lands after it."""
    from rollout_sidecar.trainer import WeightPusher

    a = servers[0]
    release = tmp_path / "release-d"
    points = tmp_path / "failpoints-d"
    points.write_text(f"catch_up.hold:{release}")
    d = late_replica(tmp_path, "peer-d", servers, points)
    outcome: dict = {}
    try:
        def timeline() -> dict:
            return catch_up_of(d)

        until(lambda: "received_s" in timeline(), "d staged every bucket of its catch-up", 300)
        assert timeline()["version"] == 6, timeline()
        step(model, seed=7)

        def push() -> None:
            try:
                with WeightPusher([s.url for s in servers] + [d.url],
                                  admin_token=a.admin_token, bucket_mb=1) as pusher:
                    outcome["result"] = pusher.push(model, version=7)
            except BaseException as e:  # noqa: BLE001 - the test fails on it below
                outcome["error"] = e

        pushing = threading.Thread(target=push, daemon=True)
        pushing.start()
        until(lambda: "trainer_waited" in timeline() or "error" in outcome,
              "the push waits for d's catch-up", 120)
        assert "error" not in outcome, outcome
        assert status(d)["weight_version"] == 0  # still held: nothing of it served yet
        refused_while_catching_up(d)
        release.touch()
        pushing.join(180)
        assert not pushing.is_alive() and "error" not in outcome, outcome
        assert outcome["result"].version == 7 and len(outcome["result"].replicas) == 4
        caught = timeline()
        assert caught["outcome"] == "caught up" and caught["version"] == 6, caught
        assert all(status(s)["weight_version"] == 7 for s in [*servers, d])
        served = prompt_logprobs(d)
        assert torch.equal(served, prompt_logprobs(a))
        assert (served - reference_logprobs(model)).abs().mean().item() < EXACT
        print(f"push during a catch-up: d's timeline {caught}")
        servers.append(d)
        held_after_a_failed_catch_up(tmp_path, servers, model)
    finally:
        release.touch()
        d.stop()


def late_replica(tmp_path, name: str, servers, points, env: dict | None = None):
    """A replica started with `--peers` at `servers` and the failpoints in
    `points`, not waited for (its catch-up is held)."""
    a = servers[0]
    return launch_server(
        log=tmp_path / f"{name}.log", dtype="float32", max_model_len=512, wait=False,
        api_token=a.api_token, admin_token=a.admin_token, ready_timeout_s=300,
        env={"ROLLOUT_SIDECAR_CACHE_DIR": str(cache_dir(tmp_path)), **TEST_ENV, **(env or {}),
             "ROLLOUT_SIDECAR_PEERS": ",".join(s.url for s in servers)}, failpoints=points)


def catch_up_of(server) -> dict:
    """Its `catch_up` timeline so far ({} while its HTTP is not up)."""
    assert server.proc.poll() is None, f"exited: {server.log.read_text()[-3000:]}"
    with contextlib.suppress(httpx.HTTPError):
        return status(server).get("catch_up") or {}
    return {}


def refused_while_catching_up(server) -> str:
    """Generation is refused (503, Retry-After, the reason), and /ready too."""
    r = httpx.post(server.url + "/generate", json={"prompts": ["x"]}, timeout=30,
                   headers={"Authorization": f"Bearer {server.api_token}"})
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    assert r.json()["error"].startswith("not serving yet: "), r.text
    assert httpx.get(server.url + "/ready", timeout=30).status_code == 503
    return r.json()["error"]


def held_after_a_failed_catch_up(tmp_path, servers, model) -> None:
    """Replica e's catch-up never ends (held, never released) and times out
    while its peers serve version 7: e stays not ready and refuses
    generation, saying why in its status, until a push commits on it; then
    it serves the push bit for bit like the others."""
    from rollout_sidecar.trainer import WeightPusher

    a = servers[0]
    points = tmp_path / "failpoints-e"
    points.write_text(f"catch_up.hold:{tmp_path / 'never'}")
    e = late_replica(tmp_path, "peer-e", servers, points,
                     {"ROLLOUT_SIDECAR_CATCH_UP_TIMEOUT_S": "5"})
    try:
        def timeline() -> dict:
            return catch_up_of(e)

        until(lambda: "held" in timeline(), "e's catch-up failed behind the fleet", 300)
        held = timeline()
        assert held["fleet_version"] == 7 and "--catch-up-timeout-s (5s)" in held["error"], held
        assert status(e)["weight_version"] == 0
        assert "the catch-up failed" in refused_while_catching_up(e)
        step(model, seed=8)
        with WeightPusher([s.url for s in servers] + [e.url], admin_token=a.admin_token,
                          bucket_mb=1) as pusher:
            result = pusher.push(model, version=8)
        assert result.version == 8 and len(result.replicas) == 5 and not result.absent
        until(lambda: httpx.get(e.url + "/ready", timeout=30).status_code == 200,
              "e ready after the push", 30)
        served = prompt_logprobs(e)
        assert torch.equal(served, prompt_logprobs(a))
        assert (served - reference_logprobs(model)).abs().mean().item() < EXACT
        print(f"a failed catch-up, held until a push: e's timeline {held}")
    finally:
        e.stop()
