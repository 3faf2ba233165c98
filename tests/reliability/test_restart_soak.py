"""A replica that dies and comes back, under load (the default commit policy,
wait; test_soak.py covers abort and keep): two float32 replicas (the
package's `reliable` server and one more), 32 rollout clients (each its own
`GenerationClient` over both URLs) and one long-lived `WeightPusher` making
16 pushes, while replica B is SIGKILLed and restarted once (60 pushes and 3
restarts with ROLLOUT_SIDECAR_FULL_SOAK=1).

What a user running a fleet needs from it:
- the pusher carries on by itself: no new pusher, no manual reconnect; a push
  fails only while B is down (all-or-nothing across replicas), and the first
  push begun once B is back succeeds;
- the clients route around the gap: no request fails (non-2xx or an exception
  reaching the rollout loop);
- no sample is off its claimed version: every response's tokens reproduce, in
  an fp32 transformers forward, the weights of the version it names (a
  restarted replica names 0, its checkpoint, until the next push).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer import WeightPusher, WeightPushError
from tests.conftest import Server, ServerSpec, serves, start_server, stop_server
from tests.reliability.conftest import TOKENS, model_of, served_version
from tests.reliability.oracle import Sample, VersionedWeights, classify

pytestmark = pytest.mark.slow
# Sized for CI: one restart shows every property (the failed pushes while B
# is down, the first push once it is back, the clients routing around it, the
# restarted replica's version 0); each restart costs a server start under load
# (about a minute and a half of the CI's two cores), and more of them show the
# same again. The size the issue asked for (60 pushes, 3 restarts, kills after
# 12, 28 and 44 committed pushes): ROLLOUT_SIDECAR_FULL_SOAK=1.
FULL = os.environ.get("ROLLOUT_SIDECAR_FULL_SOAK") == "1"
PUSHES, CLIENTS, RESTARTS = (60, 32, 3) if FULL else (16, 32, 1)
KILL_AFTER = (12, 28, 44) if FULL else (6,)  # committed pushes after which B is killed
STEP_S = 0.2  # the training step between pushes
# Each client's think time between requests: about 30 requests a second in
# all keep several in flight at every commit, kill and restart, while the
# fp32 oracle checks every sample in about a minute.
THINK_S = 1.0
# Replica B: the `reliable` server's tokens, so one pusher and one client serve both.
REPLICA_B = ServerSpec.of("restart-b", dtype="float32", env=TOKENS)


class ReplicaB:
    """Replica B, on fixed ports and tokens across its restarts."""

    def __init__(self, server: Server) -> None:
        self.server, self.tmp, self.env = server, server.tmp, dict(REPLICA_B.env)
        self.restarts = 0
        self.ready = threading.Event()
        self.ready.set()

    def kill_and_restart(self) -> None:
        """SIGKILL now; start again (same ports) in the background."""
        self.ready.clear()
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait(60)
        self.restarts += 1

        def restart() -> None:
            self.server = start_server(self.tmp, f"b-restart-{self.restarts}", dtype="float32",
                                       extra_env=self.env, like=self.server)
            self.ready.set()

        threading.Thread(target=restart, daemon=True).start()


@pytest.fixture
@serves(REPLICA_B)
def replica_b(server_plan) -> ReplicaB:
    return ReplicaB(server_plan.take(REPLICA_B))


def test_a_replica_killed_and_restarted_under_load(reliable, replica_b, oracle):
    a, b = reliable, replica_b
    urls = f"{a.url},{b.server.url}"
    weights = VersionedWeights(model_of(a))
    pusher = WeightPusher(urls, admin_token=a.admin_token, bucket_mb=1, probe=False)
    stop = threading.Event()
    samples: list[Sample] = []
    failures: list[str] = []
    requests = [0]
    pushes: list[dict] = []

    def rollouts(i: int) -> None:
        rng = random.Random(i)
        with GenerationClient(urls, api_token=a.api_token) as client:
            while not stop.is_set():
                prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 8))]]
                try:
                    r = client.generate(prompt_token_ids=prompts, sampling=dict(
                        max_tokens=rng.randint(4, 10), temperature=1.0,
                        seed=rng.randrange(1 << 30)))
                except Exception as e:  # what would reach the rollout loop
                    failures.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                requests[0] += 1
                for s in r.results[0].samples:
                    samples.append(Sample(prompts[0], s.token_ids, s.logprobs,
                                          r.versions_used, requests[0]))
                stop.wait(THINK_S)

    clients = [threading.Thread(target=rollouts, args=(i,)) for i in range(CLIENTS)]
    for t in clients:
        t.start()
    start = max(served_version(a), 0) + 1
    version, committed = start, 0
    try:
        while committed < PUSHES:
            b_up = b.ready.is_set()  # ready before this push began
            try:
                res = pusher.push(weights.load(version), version=version)
                pushes.append(dict(version=version, ok=True, encoding=res.encoding,
                                   restarted=res.server_restarted))
                committed += 1
                if committed in KILL_AFTER:
                    b.kill_and_restart()
            except WeightPushError as e:
                pushes.append(dict(version=version, ok=False, b_up=b_up,
                                   error=str(e)[:200]))
            version += 1
            time.sleep(STEP_S)
    finally:
        stop.set()
        for t in clients:
            t.join(180)
        pusher.close()
        b.ready.wait(300)
        stop_server(b.server, wait=False)
    verdicts = classify(samples, oracle, range(0, version), keep=False)
    failed = [p for p in pushes if not p["ok"]]
    row = dict(pushes=len(pushes), committed=committed, failed_pushes=len(failed),
               failed_while_b_up=sum(p["b_up"] for p in failed), restarts=b.restarts,
               saw_restart=sum(p.get("restarted", False) for p in pushes),
               encodings=sorted({p["encoding"] for p in pushes if p["ok"]}),
               requests=requests[0], failed_requests=len(failures), samples=len(samples),
               **dict(verdicts.counts))
    print("RESTART-SOAK " + json.dumps(row))
    assert b.restarts == RESTARTS
    assert not failures, failures[:5]
    # A push fails only while B is down; once it is ready, the next one lands.
    assert all(not p["b_up"] for p in failed), [p for p in failed if p["b_up"]][:3]
    verdicts.counts.pop("overlisted_responses", 0)
    assert samples and verdicts.counts["honest"] == sum(verdicts.counts.values()), \
        (dict(verdicts.counts), verdicts.examples)
    assert all(len(s.claimed) == 1 for s in samples)  # commit policy wait: one version each
