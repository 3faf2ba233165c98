"""Two real server replicas (vLLM CPU) fed by one 2-rank FSDP2 trainer
(torchrun, gloo): each bucket is broadcast once to both, and a push is
all-or-nothing across them. Then the chaos test: one replica frozen at each
phase of a push, with clients generating throughout.

One pair of servers for the module; the tests run in order and each starts
from the versions the previous one left.
"""

from __future__ import annotations

import re
import secrets
import threading
import time

import httpx
import pytest
import torch

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer import PartialCommitError, ReplicaLostError, WeightPushError
from tests.conftest import ServerSpec, serves, start_server, stop_server
from tests.e2e.chaos import PHASES, Freezer, Traffic, frozen_at, timed
from tests.e2e.push_worker import samples_alone
from tests.e2e.test_push import assert_pushed, run_worker
from tests.polling import until

# Only the chaos test is `quiet` (a frozen replica must fail a push within its
# stall bound, in wall-clock time); the others assert no time and let the next
# servers start beside them (tests/server_plan.py).
pytestmark = pytest.mark.slow


# The servers' push budget. A frozen replica must fail a push well inside it:
# the stall bound (STALL_S), not the budget, is what ends such a push.
PUSH_TIMEOUT_S = 120
STALL_S = 8


# Same tokens for both, so one trainer (and one client) talks to each.
TOKENS = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
          "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8)}
BUDGET = {"ROLLOUT_SIDECAR_PUSH_TIMEOUT_S": str(PUSH_TIMEOUT_S), **TOKENS}
REPLICA_A = ServerSpec.of("replica-a", env=BUDGET)
REPLICA_B = ServerSpec.of("replica-b", env=BUDGET, failpoints=True)  # a refused check


class Pair:
    def __init__(self, plan):
        self.a, self.b = plan.take(REPLICA_A), plan.take(REPLICA_B)
        self.tmp = self.b.tmp

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
@serves(REPLICA_A, REPLICA_B)
def pair(server_plan):
    p = Pair(server_plan)
    yield p
    for s in p.servers:
        stop_server(s, wait=False)


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
    client = GenerationClient(pair.url, api_token=pair.a.api_token)

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
        until(lambda: len(seen) >= 3, "rollouts answered before the push")
        v, _, report = push(pair, tmp_path)
        floor[0] = v + 1
        until(lambda: len(seen) >= 10 and any(got >= v + 1 for _, got in seen),
              "rollouts served by the pushed version")
    finally:
        stop.set()
        for w in workers:
            w.join(120)
        served_by = {r.url: r.outstanding for r in client.replicas()}
        client.close()
    assert_pushed(report, v)  # replica A serves the trainer's stepped weights
    # Both FSDP2 ranks sent their own rows; each bucket entered at one replica
    # and went round to the other (ring_route.py).
    assert report["own_rows"] and report["route"] == "ring", report
    a, b = report["replicas"]
    assert a["weight_version"] == b["weight_version"] == v + 1
    # Same seeded request, same weights: the same tokens and bit-identical
    # logprobs. Asked once the rollouts stopped: under load each replica batches
    # it with different requests, and CPU kernels are not batch-invariant.
    same = []
    for s in pair.servers:
        with s.client() as c:  # each sample alone in the engine (push_worker.samples_alone)
            o = samples_alone(c, [5, 6, 7, 8])
        same.append((o.weight_version, [(x.token_ids, x.logprobs) for x in o.results[0].samples]))
    assert same[0][0] == same[1][0] == v + 1 and same[0][1] == same[1][1]
    assert not errors, errors[:5]
    # Both replicas took a share of the rollouts.
    assert all(generated_tokens(s) > t for s, t in zip(pair.servers, tokens_before, strict=True))
    assert len(seen) >= 10 and all(got >= want for want, got in seen), seen
    assert {got for _, got in seen} >= {floor[0]}  # the last push was served
    assert all(n == 0 for n in served_by.values())


def test_a_delta_refused_by_one_replica_leaves_the_old_version_and_the_next_push_dense(pair):
    """A delta's patches go into each replica's staged copy at its prepare,
    outside the commit window (server/weights/commit.py). B refuses its
    prepare (a corrupted bucket: the check), so A, which prepared and
    patched, is aborted: both keep serving the old version, neither may
    take a delta against a half-patched copy, so the next push is dense, and
    both then serve the trainer's weights (the probe, and bit-identical
    answers on both)."""
    from rollout_sidecar.trainer import WeightPusher, WeightPushError
    from tests.reliability.conftest import model_of

    model = model_of(pair.a)
    g = torch.Generator().manual_seed(7)

    def sparse_step() -> None:  # 1% of every tensor's elements move
        with torch.no_grad():
            for p in model.parameters():
                hit = torch.rand(p.shape, generator=g) < 0.01
                p[hit] += 0.05 * torch.randn(int(hit.sum()), generator=g)

    v = max(pair.versions())
    with WeightPusher(pair.url, admin_token=pair.a.admin_token, bucket_mb=1) as pusher:
        for _ in range(2):  # the base, then a delta on both
            sparse_step()
            v += 1
            r = pusher.push(model, version=v)
        assert r.encoding == "delta" and pair.versions() == [v, v], r
        sparse_step()
        pair.b.failpoints.write_text("check.corrupt")
        try:
            with pytest.raises(WeightPushError, match="failed before the commit"):
                pusher.push(model, version=v + 1)
        finally:
            pair.b.failpoints.write_text("")
        assert pair.versions() == [v, v]  # nothing published anywhere
        with pair.a.client() as c:
            assert c.generate(["still v?"], sampling=dict(max_tokens=2)).weight_version == v
        r = pusher.push(model, version=v + 1)
    assert r.encoding == "dense" and "holds nothing it can patch" in r.delta_reason, r
    assert r.probe is not None and r.probe.passed, r
    answers = []
    for s in pair.servers:
        with s.client() as c:
            o = samples_alone(c, [5, 6, 7, 8])
        answers.append((o.weight_version, [x.logprobs for x in o.results[0].samples]))
    assert answers[0] == answers[1] and answers[0][0] == v + 1


def settle(pair: Pair) -> int:
    """Both replicas on one pushed version (>= 1), whatever an earlier test
    left (a failed push, a restart): pushed here, in process, if not."""
    versions = pair.versions()
    if versions[0] == versions[1] >= 1:
        return versions[0]
    from rollout_sidecar.trainer import WeightPusher
    from tests.reliability.conftest import model_of
    from tests.reliability.oracle import VersionedWeights

    v = max(versions) + 1
    with WeightPusher(pair.url, admin_token=pair.a.admin_token, bucket_mb=1) as pusher:
        pusher.push(VersionedWeights(model_of(pair.a)).load(v), version=v, probe=False)
    assert pair.versions() == [v, v]
    return v


def test_replica_killed_mid_push_publishes_nowhere_then_rejoins(pair, tmp_path):
    v = settle(pair)  # a version B cannot serve once restarted
    _, proc, report = push(pair, tmp_path, "kill_replica",
                           env={"KILL_REPLICA_PID": str(pair.b.proc.pid)})
    assert report["error"] and pair.b.url in report["error"], report
    print("chaos: SIGKILL mid-transfer:", {k: report.get(k) for k in ("to_error_s", "error")})
    pair.b.proc.wait(30)
    with pair.a.client() as c:  # the survivor kept serving the old version
        r = c.generate(["still serving?"], sampling=dict(max_tokens=4))
        assert r.weight_version == v
        assert c.info().weight_version == v
    # The killed replica comes back on its checkpoint (version 0); the next
    # push rebuilds the group with it and brings both to the same version.
    pair.b = start_server(pair.tmp, "replica-b-restarted", like=pair.b)
    assert pair.versions() == [v, 0]
    # With no push in flight, B refuses version v at once (naming why, with
    # Retry-After), and a fresh client asks the versions first: B, listed
    # first, never gets the request.
    r = httpx.post(pair.b.url + "/generate", json={"prompts": ["x"], "min_weight_version": v},
                   headers={"Authorization": f"Bearer {pair.b.api_token}"}, timeout=60)
    assert r.status_code == 409 and "no push is in flight" in r.json()["error"], r.text
    assert int(r.headers["retry-after"]) >= 1
    before = generated_tokens(pair.b)
    with GenerationClient([pair.b.url, pair.a.url], api_token=pair.a.api_token) as fresh:
        r = fresh.generate(["x"], min_weight_version=v, sampling=dict(max_tokens=4))
    assert r.weight_version == v and r.replica == pair.a.url and r.retried == []
    assert generated_tokens(pair.b) == before
    _, _, report = push(pair, tmp_path)
    assert_pushed(report, v)
    a, b = report["replicas"]
    assert a["weight_version"] == b["weight_version"] == v + 1
    assert a["logprobs"] == b["logprobs"]


# ------------------------------------------------------------------- chaos


@pytest.fixture(scope="module")
def chaos_trainer(pair):
    from rollout_sidecar.trainer import WeightPusher
    from tests.reliability.conftest import model_of
    from tests.reliability.oracle import VersionedWeights

    pusher = WeightPusher(pair.url, admin_token=pair.a.admin_token, bucket_mb=1,
                          stall_timeout_s=STALL_S)
    yield pusher, VersionedWeights(model_of(pair.a))
    pusher.close()


@pytest.mark.quiet
def test_a_frozen_replica_fails_the_push_fast_naming_it_while_clients_keep_going(
        pair, chaos_trainer, record_property):
    """Replica B frozen (SIGSTOP of its server and engine) at each phase of a
    push, four client threads generating over both replicas throughout: the
    push fails within the stall bounds, not the push budget, on every phase,
    naming B as frozen; before the commit no response carries the failed
    version; after it, the error says which version is live where; the
    clients keep completing requests on A; and once B is thawed the next push
    succeeds on both."""
    pusher, weights = chaos_trainer
    rows = []
    with Traffic(pair.url, pair.a.api_token, stall_timeout_s=5) as traffic:
        until(lambda: len(traffic.done) >= 4, "the clients' traffic flowing")
        for phase in PHASES:
            before = pair.versions()
            v = max(before) + 1
            freezer = Freezer(pair.b.proc.pid)
            try:
                with frozen_at(pusher, 1, phase, freezer):
                    _, out = timed(lambda v=v: pusher.push(weights.load(v), version=v))
                failed_at = time.monotonic()
                froze = freezer.frozen_at
            finally:
                freezer.thaw()
            assert froze is not None, f"{phase}: the failpoint never froze B"
            during = (froze, failed_at)
            row = dict(phase=phase, to_error_s=round(failed_at - froze, 1),
                       error=str(out), per_10s=round(traffic.per_10s(*during), 1),
                       served_during=sorted(traffic.versions(*during)))
            assert isinstance(out, WeightPushError), (phase, out)
            assert failed_at - froze < PUSH_TIMEOUT_S / 2, row
            assert pair.b.url in str(out) and "frozen" in str(out), row
            if phase in ("begin", "transfer", "prepare"):  # nothing published anywhere
                assert v not in row["served_during"], row
                assert type(out) is WeightPushError and not out.live, row
            elif phase == "commit":
                assert isinstance(out, PartialCommitError), row
                assert out.live[pair.a.url] == v and out.live[pair.b.url] is None, row
            else:
                assert isinstance(out, ReplicaLostError), row
                assert out.live == {pair.a.url: v, pair.b.url: v}, row
            assert row["per_10s"] > 0, row  # A kept serving the clients
            row["live_after_thaw"] = pair.versions()
            nxt = max(row["live_after_thaw"]) + 1
            row["next_push_s"], result = timed(
                lambda nxt=nxt: pusher.push(weights.load(nxt), version=nxt))
            assert not isinstance(result, BaseException), (row, result)
            assert pair.versions() == [nxt, nxt], row
            rows.append(row)
            print("chaos:", row)  # the fault table of docs/replicas.md
    record_property("chaos", rows)
    assert len(traffic.done) > 0 and not traffic.errors, traffic.errors[:5]
