"""Two real server replicas (vLLM CPU) fed by one 2-rank FSDP2 trainer
(torchrun, gloo): each bucket is broadcast once to both, and a push is
all-or-nothing across them.

One pair of servers for the module; the tests run in order and each starts
from the versions the previous one left.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from rollout_sidecar.client import GenerationClient
from tests.conftest import start_server, stop_server
from tests.e2e.test_push import assert_pushed, run_worker

pytestmark = pytest.mark.slow


class Pair:
    def __init__(self, tmp):
        self.tmp = tmp
        self.a = start_server(tmp, "replica-a")
        # Same tokens for both, so one trainer (and one client) talks to each.
        self.b = start_server(tmp, "replica-b", extra_env={
            "ROLLOUT_SIDECAR_API_TOKEN": self.a.api_token,
            "ROLLOUT_SIDECAR_ADMIN_TOKEN": self.a.admin_token})
        self.b.api_token, self.b.admin_token = self.a.api_token, self.a.admin_token

    @property
    def servers(self):
        return [self.a, self.b]

    @property
    def url(self) -> str:  # what a trainer or client is given: both replicas
        return ",".join(s.url for s in self.servers)

    def versions(self) -> list[int]:
        out = []
        for s in self.servers:
            with s.client() as c:
                out.append(c.info().weight_version)
        return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = Pair(tmp_path_factory.mktemp("replicas"))
    yield p
    for s in p.servers:
        stop_server(s)


def generated_tokens(server) -> float:
    text = httpx.get(server.url + "/metrics",
                     headers={"Authorization": f"Bearer {server.api_token}"}).text
    return float(re.search(r"^rollout_sidecar_generated_tokens_total (\S+)$", text, re.M)[1])


def push(pair: Pair, tmp_path, mode: str = "fsdp2", env: dict | None = None, check=True):
    v = max(pair.versions())
    # Both replicas share tokens: the worker gets replica A's.
    proc, report = run_worker(pair.a, mode, v + 1, tmp_path, check=check, env=env, url=pair.url)
    return v, proc, report


def test_a_push_under_rollouts_reaches_both_replicas_identically(pair, tmp_path):
    """Rollouts spread over both replicas while the trainer pushes: none fails,
    each lands on a version >= the min_weight_version it asked for, and after
    the push both replicas serve the trainer's weights, bit-identically."""
    floor = [min(pair.versions())]  # a version both replicas hold
    stop = threading.Event()
    seen: list[tuple[int, int]] = []
    errors: list[str] = []
    client = GenerationClient(pair.url, token=pair.a.api_token)

    def rollouts():
        i = 0
        while not stop.is_set():
            want = floor[0]
            try:
                r = client.generate([f"episode {i}"], min_weight_version=want,
                                    sampling=dict(max_tokens=8, seed=i), session_key=f"ep{i % 5}")
                seen.append((want, r.weight_version))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
            i += 1

    tokens_before = [generated_tokens(s) for s in pair.servers]
    workers = [threading.Thread(target=rollouts) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(1)
        v, _, report = push(pair, tmp_path)
        floor[0] = v + 1
        time.sleep(2)
    finally:
        stop.set()
        for w in workers:
            w.join(120)
        served_by = {r.url: r.outstanding for r in client.replicas()}
        client.close()
    assert_pushed(report, v)  # replica A serves the trainer's stepped weights
    a, b = report["replicas"]
    assert a["weight_version"] == b["weight_version"] == v + 1
    # Same seeded request, same weights: the same tokens and bit-identical logprobs.
    assert a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]
    assert not errors, errors[:5]
    # Both replicas took a share of the rollouts.
    assert all(generated_tokens(s) > t for s, t in zip(pair.servers, tokens_before, strict=True))
    assert len(seen) >= 10 and all(got >= want for want, got in seen), seen
    assert {got for _, got in seen} >= {floor[0]}  # the last push was served
    assert all(n == 0 for n in served_by.values())


def test_replica_killed_mid_push_publishes_nowhere_then_rejoins(pair, tmp_path):
    v = max(pair.versions())
    _, proc, report = push(pair, tmp_path, "kill_replica",
                           env={"KILL_REPLICA_PID": str(pair.b.proc.pid)})
    assert report["error"], report
    pair.b.proc.wait(30)
    with pair.a.client() as c:  # the survivor kept serving the old version
        r = c.generate(["still serving?"], sampling=dict(max_tokens=4))
        assert r.weight_version == v
        assert c.info().weight_version == v
    # The killed replica comes back on its checkpoint (version 0); the next
    # push rebuilds the group with it and brings both to the same version.
    pair.b = start_server(pair.tmp, "replica-b-restarted", like=pair.b)
    assert pair.versions() == [v, 0]
    _, _, report = push(pair, tmp_path)
    assert_pushed(report, v)
    a, b = report["replicas"]
    assert a["weight_version"] == b["weight_version"] == v + 1
    assert a["logprobs"] == b["logprobs"]
