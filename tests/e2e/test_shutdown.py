"""SIGTERM drains: the in-flight request completes, new ones are refused."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.conftest import ServerSpec, serves, stop_server
from tests.polling import metric as gauge
from tests.polling import until

# quiet: the drain is asserted against wall-clock deadlines.
pytestmark = [pytest.mark.slow, pytest.mark.quiet]
# Its own server, since the test stops it; planned, so the start overlaps the
# tests before this quiet one instead of running alone in it.
DRAIN = ServerSpec("drain")


@pytest.fixture
@serves(DRAIN)
def drain_server(server_plan):
    s = server_plan.take(DRAIN)
    yield s
    stop_server(s)  # the test's SIGTERM stopped it; this stops it if the test failed first


def draining(keepalive: httpx.Client) -> bool:
    """/ready says 503 once SIGTERM is seen, or the idle connection is closed."""
    try:
        return keepalive.get("/ready").status_code == 503
    except httpx.TransportError:
        return True


def test_sigterm_drains_in_flight_then_exits(drain_server):
    server = drain_server
    result: dict = {}

    def long_request():
        with server.client(timeout=120) as c:
            result["r"] = c.generate(prompt_token_ids=[[1, 2, 3]] * 8,
                                     sampling=dict(max_tokens=400, n=4, seed=0))

    with httpx.Client(base_url=server.url) as keepalive:
        assert keepalive.get("/ready").status_code == 200
        t = threading.Thread(target=long_request)
        t.start()
        until(lambda: gauge(server, "rollout_sidecar_engine_unfinished_requests") > 0,
              "the request reached the engine")
        server.proc.send_signal(signal.SIGTERM)
        until(lambda: draining(keepalive), "the server saw SIGTERM")
        # A new request is refused: 503 on a kept-alive connection, or the
        # listener is already closed.
        try:
            r = keepalive.post("/generate", json={"prompts": ["x"]},
                               headers={"Authorization": f"Bearer {server.api_token}"})
            assert r.status_code == 503
        except httpx.TransportError:
            pass
        t.join(120)
    r = result["r"]
    samples = [s for p in r.results for s in p.samples]
    # Drained, not cut off: every sample ended on its own (EOS or max_tokens).
    assert len(samples) == 32
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    assert sum(len(s.token_ids) for s in samples) > 32 * 50
    # uvicorn re-raises the SIGTERM it caught once shutdown is complete, so a
    # clean drain exits with -SIGTERM (0 on older uvicorn); a hang or crash fails.
    assert server.proc.wait(120) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log.read_text()
