"""The pusher's deadlines and per-replica error words (issue 20, parts 1-2).

Unit tests against real sockets on localhost: a "frozen" server is a
listening socket that accepts connections and never answers (what a
SIGSTOPped server looks like from outside: the kernel still completes the TCP
handshake); an "unreachable" one is a port nobody listens on. Fake admin
servers (httpx.MockTransport) stand in for the refusals; the real two-replica
chaos test is tests/e2e/test_replicas.py. Bounds here are far apart (a
0.3 s stall bound against a 60 s budget), and the assertions are about which
error, not how fast.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from rollout_sidecar.protocol.schema import CommitResponse
from rollout_sidecar.trainer import PartialCommitError, ReplicaError, ReplicaLostError
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from rollout_sidecar.trainer.control.deadlines import Deadlines, Stalled, watched
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.errors import from_kind, kind_of
from rollout_sidecar.trainer.probe import lost_in_probe
from rollout_sidecar.trainer.two_phase import TwoPhaseCommit
from tests.conftest import free_port

STALL = Deadlines(stall_s=0.3)
BUDGET_S = 60.0  # a phase's budget: only the stall bound may end these calls


@pytest.fixture
def frozen_url():
    """A server that accepts every connection and never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    sock.close()


def test_a_quick_call_to_a_frozen_server_is_frozen_after_the_stall_bound(frozen_url):
    admin = WeightAdminClient(frozen_url, "t", STALL)
    with pytest.raises(ReplicaError) as e:
        admin.status()
    assert (e.value.url, e.value.phase, e.value.what) == (frozen_url, "status", "frozen")
    assert str(e.value).startswith(f"{frozen_url}: frozen during status: connected, then silent")


def test_a_long_call_is_watched_and_given_up_when_the_server_stops_answering(frozen_url):
    """The commit may take its budget (60 s); the liveness check ends it."""
    admin = WeightAdminClient(frozen_url, "t", STALL)
    with pytest.raises(ReplicaError) as e:
        admin.commit("p", None, timeout_s=BUDGET_S)
    assert (e.value.phase, e.value.what) == ("commit", "frozen")
    assert "GET /ready unanswered" in str(e.value)


def test_a_slow_call_on_a_live_server_runs_to_its_answer():
    """Slow is not frozen: while /ready answers, the watched call waits."""
    release = threading.Event()
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/ready":
            if calls.count("/ready") >= 3:
                release.set()
            return httpx.Response(200, json={"status": "ok"})
        assert release.wait(30)  # the commit answers only after three liveness checks
        return httpx.Response(200, json=CommitResponse(
            push_id="p", weight_version=3, commit_policy="wait", timings={}).model_dump())

    admin = WeightAdminClient("http://a", "t", Deadlines(stall_s=0.15))
    admin._http = httpx.Client(base_url="http://a", transport=httpx.MockTransport(handler))
    assert admin.commit("p", None, timeout_s=BUDGET_S).weight_version == 3
    assert calls.count("/ready") >= 3


def test_nobody_listening_is_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ReplicaError) as e:
        WeightAdminClient(url, "t", STALL).begin(1, "gloo", [], None, None, BUDGET_S)
    assert (e.value.phase, e.value.what) == ("begin", "unreachable")


def refusing(status: int, error: str) -> WeightAdminClient:
    admin = WeightAdminClient("http://r", "t", STALL)
    admin._http = httpx.Client(base_url="http://r", transport=httpx.MockTransport(
        lambda r: httpx.Response(status, json={"error": error})))
    return admin


def test_refused_and_failed_carry_the_servers_reason():
    with pytest.raises(ReplicaError) as e:
        refusing(409, "a push is in progress").prepare("p", [1], BUDGET_S)
    assert e.value.what == "refused" and "a push is in progress" in str(e.value)
    with pytest.raises(ReplicaError) as e:
        refusing(503, "load failed: CUDA OOM").commit("p", None, BUDGET_S)
    assert e.value.what == "failed" and "load failed: CUDA OOM" in str(e.value)


def test_watched_returns_the_answer_and_raises_stalled_on_a_dead_check():
    assert watched(lambda: 7, lambda: None, STALL) == 7
    with pytest.raises(ValueError):
        watched(lambda: int("x"), lambda: None, STALL)
    gate = threading.Event()

    def dead() -> None:
        raise httpx.ReadTimeout("silent")
    with pytest.raises(Stalled):
        watched(lambda: gate.wait(30), dead, STALL)
    gate.set()


class _Transport:
    name, connection_id = "gloo", "c"

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_a_commit_frozen_on_one_replica_says_which_version_is_live_where(frozen_url):
    live = "http://live"
    rs = ReplicaAdmins([live, frozen_url], "t", STALL)
    ok = CommitResponse(push_id="p", weight_version=5, commit_policy="wait", timings={})
    rs.admins[0]._http = httpx.Client(base_url=live, transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json=ok.model_dump())))
    with pytest.raises(PartialCommitError) as e:
        TwoPhaseCommit(rs, _Transport()).commit(["p", "p"], BUDGET_S)
    assert e.value.live == {live: 5, frozen_url: None}
    assert f"{frozen_url}: failed (frozen during commit: connected" in str(e.value)
    assert f"live: {live} v5, {frozen_url} unknown" in str(e.value)
    # The same facts reach every trainer rank (errors cross ranks as kind + message + live).
    again = from_kind(kind_of(e.value), str(e.value), e.value.live)
    assert type(again) is PartialCommitError and again.live == e.value.live


def test_a_probe_that_cannot_reach_a_replica_says_the_version_is_live_on_both():
    lost = ReplicaError("http://b", "probe", "frozen", "connected, then silent for 15s")
    e = lost_in_probe(9, ["http://a", "http://b"], [object(), lost], [1])
    assert isinstance(e, ReplicaLostError) and e.live == {"http://a": 9, "http://b": 9}
    assert "version 9 committed and live on every replica" in str(e)
    assert "http://b: frozen during probe" in str(e) and "probed: http://a" in str(e)
