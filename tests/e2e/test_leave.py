"""A replica's leave, as the Helm chart's preStop runs it (`rollout-sidecar
drain`, then SIGTERM): a push that began before the drain runs to its end and
its probe passes; a generation request in flight finishes; new generation
and a trainer's next status read get 503 (so its next push goes on without
this replica, trainer/control/serving_state.py); the drain answers once
nothing is left; SIGTERM then exits cleanly. Real server, real pusher, the
real CLI. The same leave in a fleet under load, with joins: bench/elastic_fleet.py
(docs/replicas.md, "A fleet that changes")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.conftest import ServerSpec, serves, stop_server
from tests.polling import until

pytestmark = pytest.mark.slow
LEAVE = ServerSpec.of("leave", dtype="float32")


@pytest.fixture
@serves(LEAVE)
def leaving(server_plan):
    s = server_plan.take(LEAVE)
    yield s
    stop_server(s)  # the test's SIGTERM stopped it; this stops it if the test failed first


def test_a_leave_lets_a_begun_push_and_a_request_finish_then_exits(leaving, tmp_path):
    from rollout_sidecar.trainer import WeightPusher
    from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
    from tests.reliability.conftest import model_of
    from tests.reliability.oracle import VersionedWeights

    server = leaving
    api = {"Authorization": f"Bearer {server.api_token}"}
    drain: dict = {}

    def start_drain() -> None:
        """The chart's preStop, from outside the server's process."""
        drain["proc"] = subprocess.Popen(
            [sys.executable, "-m", "rollout_sidecar.server.cli", "drain", "--url", server.url,
             "--timeout-s", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "ROLLOUT_SIDECAR_ADMIN_TOKEN": server.admin_token})

    def draining() -> bool:
        return httpx.get(server.url + "/ready", timeout=10).status_code == 503

    result: dict = {}

    def long_request() -> None:
        r = httpx.post(server.url + "/generate", headers=api, timeout=120, json={
            "prompt_token_ids": [[1, 2, 3]] * 4, "sampling": {"max_tokens": 300, "n": 2,
                                                              "seed": 0}})
        result["generate"] = r

    weights = VersionedWeights(model_of(server))
    requester = threading.Thread(target=long_request)
    with WeightPusher(server.url, admin_token=server.admin_token, bucket_mb=1) as pusher:
        # The drain starts between the push's data and its commit: the commit and
        # the probe after it must still pass. (This pusher's admin client only.)
        assert pusher.replicas is not None
        admin: WeightAdminClient = pusher.replicas.listed[0]
        real_commit = admin.commit

        def commit_after_the_drain_began(*args, **kw):
            start_drain()
            until(draining, "the server drains", 60)
            return real_commit(*args, **kw)

        requester.start()
        admin.commit = commit_after_the_drain_began  # type: ignore[method-assign]
        pushed = pusher.push(weights.load(1), version=1)
        admin.commit = real_commit  # type: ignore[method-assign]
        assert pushed.version == 1 and pushed.probe is not None and pushed.probe.passed, pushed
        # New work is refused, each with its reason; a trainer's next push skips it.
        r = httpx.post(server.url + "/generate", headers=api, json={"prompts": ["x"]},
                       timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        with pytest.raises(Exception, match="no replica can take this push: .*leaving: "):
            pusher.push(weights.load(2), version=2)
    requester.join(120)
    assert result["generate"].status_code == 200  # finished, not cut
    samples = [s for p in result["generate"].json()["results"] for s in p["samples"]]
    assert len(samples) == 8 and all(s["finish_reason"] in ("stop", "length") for s in samples)
    out, err = drain["proc"].communicate(timeout=120)
    answer = json.loads(out.split("drain: ", 1)[1])
    assert answer["drained"] is True and answer["requests_in_flight"] == 0, (out, err)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM
    assert "Application shutdown complete" in server.log.read_text()
