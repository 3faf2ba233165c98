"""Failover around a stalled, reset or behind replica (issue 20, part 3).

Unit tests with a fake server: the client's side runs against httpx.MockTransport
(the project allows fake servers only in unit tests that say so), whose
handler blocks like a frozen replica or raises the transport errors a dying
one causes. The routing clock is fake (see tests/test_client_routing.py); the
liveness watch waits for real, on a 0.05 s stall bound, and nothing asserts a
duration. The server's side is the real `VersionGate` and the real
409 response builder. Two real replicas, one SIGSTOPped, are in
tests/reliability/test_stalled_replica.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from rollout_sidecar.client import AsyncGenerationClient, RetryPolicy, SidecarError
from rollout_sidecar.server.engine.version_gate import MinVersionTimeout, VersionGate
from tests.test_client_routing import FakeTime, Fleet, generated, url

FAST = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.02, stall_down_s=30)
STALL_S = 0.05  # the clients' stall bound here: how often a waiting request checks /health


@pytest.fixture
def fake_time(monkeypatch):
    return FakeTime(monkeypatch)


def stalled(host: str) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(f"{host}: no byte within the read timeout")


class Frozen(Fleet):
    """A fleet in which the hosts in `frozen` accept and never answer: a
    /generate there blocks (until the test ends, then times out reading),
    anything else times out at once. Each request's read timeout is kept."""

    def __init__(self, frozen: set[str], **versions: int) -> None:
        super().__init__(**versions)
        self.frozen = frozen
        self.read_timeouts: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()
        self.thawed = threading.Event()  # set when the test is done with the fleet

    def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        with self.lock:
            self.read_timeouts.append((host, path, request.extensions["timeout"]["read"]))
            frozen = host in self.frozen
            if frozen:
                self.calls.append((host, path))
            else:
                return super().handler(request)
        if path == "/generate":
            self.thawed.wait(30)
        raise stalled(host)


@pytest.fixture
def frozen_fleet():
    fleets: list[Frozen] = []

    def make(frozen: set[str], **versions: int) -> Frozen:
        fleets.append(Frozen(frozen, **versions))
        return fleets[-1]
    yield make
    for fleet in fleets:
        fleet.thawed.set()  # the abandoned requests end, in their daemon threads


def test_a_frozen_replica_loses_its_request_and_is_skipped_while_the_other_serves(
        fake_time, frozen_fleet):
    fleet = frozen_fleet({"a"}, a=1, b=1)
    with fleet.client(fake_time, retry=FAST, stall_timeout_s=STALL_S, timeout=300) as c:
        answers = [c.generate(["x"]) for _ in range(6)]
        a = c.replicas()[0]
    assert [r.weight_version for r in answers] == [1] * 6
    # The retried request says so: b answered it, after a try on a that froze.
    assert {r.replica for r in answers} == {url("b")}
    [retried] = [r.retried for r in answers if r.retried]
    assert len(retried) == 1 and retried[0].startswith(f"{url('a')}: frozen")
    # One try on a, one liveness ping that went unanswered, then skipped.
    assert fleet.hosts() == {"a": 1, "b": 6} and fleet.hosts("/health") == {"a": 1}
    assert a.down_for_s == FAST.stall_down_s and a.last_error.startswith("frozen")
    assert fake_time.sleeps == []
    generate_reads = {t for h, p, t in fleet.read_timeouts if p == "/generate"}
    assert generate_reads == {300}  # no short read bound: the watch ends a frozen try


def test_threads_sharing_a_client_all_finish_on_the_live_replica(frozen_fleet):
    fleet = frozen_fleet({"b"}, a=2, b=2)
    results: list[int] = []
    with fleet.client(retry=FAST, stall_timeout_s=STALL_S) as c:
        def work() -> None:
            for _ in range(5):
                results.append(c.generate(["x"]).weight_version)
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [2] * 40
    assert fleet.hosts()["a"] == 40 and fleet.hosts()["b"] >= 1


def slow_handler(fleet: Fleet, busy_s: float):
    """`fleet`'s handler, but a /generate takes `busy_s` (real time) while
    /health answers at once: a replica busy with a long generation."""
    inner = fleet.handler

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            fleet.calls.append((request.url.host, "/health"))
            return httpx.Response(200, json={"status": "ok"})
        time.sleep(busy_s)
        return inner(request)
    return handler


def test_a_slow_but_alive_replica_keeps_its_request_however_long_it_runs():
    # Sending it again would start the generation over, possibly on newer
    # weights (a push that commits meanwhile): the CI failure that led here.
    fleet = Fleet(a=1)
    with fleet.client(retry=FAST, stall_timeout_s=STALL_S, timeout=120) as c:
        c._http._transport = httpx.MockTransport(slow_handler(fleet, busy_s=20 * STALL_S))
        assert c.generate(["x"]).weight_version == 1
        a = c.replicas()[0]
    assert fleet.hosts() == {"a": 1}, "one try: never sent again"
    assert fleet.hosts("/health")["a"] >= 2  # checked while it ran
    assert a.down_for_s == 0 and a.last_error is None


def test_the_async_client_keeps_a_slow_request_and_gives_up_a_frozen_one(frozen_fleet):
    async def busy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        await asyncio.sleep(20 * STALL_S)
        return httpx.Response(200, json=generated(1))

    async def slow() -> int:
        async with AsyncGenerationClient(url("a"), retry=FAST, stall_timeout_s=STALL_S,
                                         transport=httpx.MockTransport(busy)) as c:
            return (await c.generate(["x"])).weight_version
    assert asyncio.run(slow()) == 1

    async def frozen(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            return httpx.Response(200, json=generated(1))
        if request.url.path == "/generate":
            await asyncio.sleep(30)  # cancelled by the watch
        raise stalled("a")

    async def failover() -> tuple[int, str]:
        async with AsyncGenerationClient([url("b"), url("a")], retry=FAST,  # a is first
                                         stall_timeout_s=STALL_S,
                                         transport=httpx.MockTransport(frozen)) as c:
            version = (await c.generate(["x"])).weight_version
            return version, c.replicas()[1].last_error
    version, error = asyncio.run(failover())
    assert version == 1 and error.startswith("frozen: connected, then silent")


def test_a_connection_reset_mid_request_moves_to_another_replica(fake_time):
    fleet = Fleet(a=1, b=1)
    for error in (httpx.RemoteProtocolError("Server disconnected without sending a response"),
                  httpx.ReadError("[Errno 104] Connection reset by peer")):
        fleet.script["a"] = [error]
        fleet.calls.clear()
        with fleet.client(fake_time, hosts=["b", "a"], retry=FAST) as c:  # a is first
            assert c.generate(["x"]).weight_version == 1
            a = c.replicas()[1]
        assert fleet.calls == [("a", "/generate"), ("b", "/generate")]
        assert a.down_for_s > 0 and a.last_error.startswith("connection reset")


def test_when_every_replica_is_frozen_the_error_names_each_at_once(fake_time, frozen_fleet):
    fleet = frozen_fleet({"a", "b"}, a=1, b=1)
    with fleet.client(fake_time, retry=FAST, stall_timeout_s=STALL_S) as c:
        with pytest.raises(httpx.ReadTimeout) as e:
            c.generate(["x"])
    message = str(e.value)
    for host in ("a", "b"):
        assert f"{url(host)}: frozen: connected, then silent for {STALL_S:g}s" in message
    assert fake_time.sleeps == [] and fleet.hosts() == {"a": 1, "b": 1}


def test_the_final_error_says_what_happened_at_each_kind_of_replica(fake_time, frozen_fleet):
    fleet = frozen_fleet({"a"}, a=1, b=1, c=1)
    fleet.script["b"] = [httpx.ConnectError("connection refused by b")] * 9
    fleet.script["c"] = [httpx.RemoteProtocolError("Server disconnected")] * 9
    with fleet.client(fake_time, retry=RetryPolicy(attempts=3, stall_down_s=30),
                      stall_timeout_s=STALL_S) as c, pytest.raises(httpx.TransportError) as e:
        c.generate(["x"])
    message = str(e.value)
    assert "frozen: connected, then silent" in message
    assert "unreachable (ConnectError" in message
    assert "connection reset mid-request" in message


def test_a_fresh_client_learns_versions_before_a_min_weight_version_request():
    fleet = Fleet(a=0, b=18)  # a restarted at v0
    with fleet.client(hosts=["a", "b"]) as c:
        assert c.generate(["x"], min_weight_version=18).weight_version == 18
        assert c.generate(["x"], min_weight_version=18).weight_version == 18
        assert [r.weight_version for r in c.replicas()] == [0, 18]
    assert fleet.hosts("/info") == {"a": 1, "b": 1}  # asked once, not per request
    assert fleet.hosts() == {"b": 2}  # a never got the request it would refuse


def test_a_frozen_replica_does_not_stall_the_version_check(fake_time, frozen_fleet):
    fleet = frozen_fleet({"a"}, a=18, b=18)
    with fleet.client(fake_time, retry=FAST, stall_timeout_s=3) as c:
        assert c.generate(["x"], min_weight_version=18).weight_version == 18
        a = c.replicas()[0]
    info_reads = [t for h, p, t in fleet.read_timeouts if p == "/info"]
    assert info_reads and max(info_reads) <= 3  # a ping is bounded by the stall bound
    assert fleet.hosts() == {"b": 1} and a.down_for_s == FAST.stall_down_s


def test_every_replica_refusing_the_version_raises_409_naming_each(fake_time):
    fleet = Fleet(a=1, b=2)
    with fleet.client(fake_time, retry=FAST) as c, pytest.raises(SidecarError) as e:
        c.generate(["x"], min_weight_version=5)
    assert e.value.status == 409 and e.value.field == "min_weight_version"
    assert url("a") in str(e.value) and url("b") in str(e.value)


# ------------------------------------------------------------------ server side


def test_a_version_no_push_brings_is_refused_at_once_with_retry_after():
    async def main() -> None:
        gate = VersionGate(0)
        gate.push_pending = lambda: False
        # A day's wait: only the missing push can make this answer.
        with pytest.raises(MinVersionTimeout) as e:
            await asyncio.wait_for(gate.admit(18, timeout_s=86400), 30)
        assert "no push is in flight" in str(e.value) and "holds 0" in str(e.value)
        assert e.value.retry_after_s >= 1  # the app answers 409 with this Retry-After
        assert gate.gated == 0 and gate.in_flight == 0

    asyncio.run(main())


@pytest.mark.parametrize("push_brings_it", [True, False])
def test_a_request_waits_while_a_push_is_in_flight_and_ends_with_it(push_brings_it):
    """Admitted with the version the push published, or, when the push ends
    without it (failed, aborted), refused at once rather than at the timeout."""
    async def main() -> None:
        gate = VersionGate(0)
        pushing = [True]
        gate.push_pending = lambda: pushing[0]
        waiter = asyncio.create_task(gate.admit(1, timeout_s=86400))
        await asyncio.sleep(0.01)
        assert not waiter.done() and gate.gated == 1
        if push_brings_it:
            await gate.publish(1)
        pushing[0] = False
        if push_brings_it:
            assert (await asyncio.wait_for(waiter, 30)).version == 1
        else:
            with pytest.raises(MinVersionTimeout):
                await asyncio.wait_for(waiter, 30)

    asyncio.run(main())


def test_a_gate_nobody_tells_about_pushes_waits_as_before():
    async def main() -> None:
        gate = VersionGate(0)  # push_pending None: unknown
        with pytest.raises(MinVersionTimeout) as e:
            await gate.admit(1, timeout_s=0.05)
        assert "not reached within" in str(e.value)

    asyncio.run(main())
