"""Client routing over several replicas.

These are unit tests with a fake server: every replica is a host name behind
one httpx.MockTransport (the project allows fake servers only in unit tests
that say so). Time is fake too: the pool reads a fake clock and time.sleep /
asyncio.sleep are replaced by recorders that advance it, so nothing here
waits and nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rollout_sidecar.client import (
    AsyncGenerationClient,
    GenerationClient,
    RetryPolicy,
    SidecarError,
)
from rollout_sidecar.client.replica_pool import ReplicaPool

FAST = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.02)


def url(host: str) -> str:
    return f"http://{host}:8000"


def generated(version: int) -> dict:
    return {"results": [{"prompt_token_ids": [1], "samples": [
        {"text": "a", "token_ids": [97], "logprobs": [-0.5], "finish_reason": "length"}]}],
        "weight_version": version, "versions_used": [version],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def info(version: int) -> dict:
    return {"model": "m", "dtype": "bfloat16", "lm_head_dtype": "float32",
            "max_model_len": 64, "vocab_size": 100, "weight_version": version,
            "boot_id": "b", "num_parameters": 1, "commit_policy": "wait",
            "transports": ["http"]}


class Fleet:
    """Fake replicas, one per host name, each serving `versions[host]`.

    `script[host]` holds what that host answers first (responses or
    exceptions to raise) to anything but the client's version and liveness
    pings (GET /info, /health), before it behaves normally. Like the real server,
    a replica behind `min_weight_version` answers 409 naming that field."""

    def __init__(self, **versions: int) -> None:
        self.versions = versions
        self.script: dict[str, list] = {h: [] for h in versions}
        self.calls: list[tuple[str, str]] = []  # (host, path) in order

    def hosts(self, path: str = "/generate") -> Counter:
        return Counter(h for h, p in self.calls if p == path)

    def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.calls.append((host, path))
        if self.script[host] and path not in ("/info", "/health"):
            item = self.script[host].pop(0)
            if isinstance(item, Exception):
                raise item
            return item
        version = self.versions[host]
        if path in ("/ready", "/health"):
            return httpx.Response(200, json={"status": "ok"})
        if path == "/info":
            return httpx.Response(200, json=info(version))
        need = json.loads(request.content).get("min_weight_version")
        if need is not None and need > version:
            return httpx.Response(409, json={"error": f"version {need} did not arrive",
                                             "field": "min_weight_version"})
        return httpx.Response(200, json=generated(version))

    def client(self, clock: FakeTime | None = None, hosts: list[str] | None = None,
               **kw) -> GenerationClient:
        urls = [url(h) for h in hosts or self.versions]
        c = GenerationClient(urls, retry=kw.pop("retry", FAST),
                             transport=httpx.MockTransport(self.handler), **kw)
        if clock is not None:
            clock.attach(c, urls)
        return c


class FakeTime:
    """A clock that only moves when the client sleeps (or the test says)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        monkeypatch.setattr(time, "sleep", self.sleep)

        async def async_sleep(seconds: float) -> None:
            self.sleep(seconds)
        monkeypatch.setattr(asyncio, "sleep", async_sleep)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def attach(self, client: GenerationClient | AsyncGenerationClient, urls: object,
               refresh_s: float = 30.0) -> None:
        # The pool is the client's private part; a fresh one on the fake clock,
        # with the client's hold on the shared liveness verdicts.
        client._pool = ReplicaPool(urls, refresh_s=refresh_s, clock=self.clock,
                                   liveness=client._liveness)


@pytest.fixture
def fake_time(monkeypatch):
    return FakeTime(monkeypatch)


def unavailable(retry_after: float) -> httpx.Response:
    return httpx.Response(503, headers={"Retry-After": str(retry_after)},
                          json={"error": "draining"})


def refused(host: str) -> httpx.ConnectError:
    return httpx.ConnectError(f"connection refused by {host}")


# ------------------------------------------------------------------ URL forms


def test_one_url_a_list_or_a_comma_separated_string(monkeypatch):
    transport = httpx.MockTransport(lambda r: httpx.Response(200))
    forms = {"http://a:8000": ["http://a:8000"],
             "http://a:8000, http://b:8000/": ["http://a:8000", "http://b:8000"],
             ("http://a:8000", "http://b:8000"): ["http://a:8000", "http://b:8000"]}
    for given, expected in forms.items():
        with GenerationClient(given, transport=transport) as c:
            assert [r.url for r in c.replicas()] == expected
    monkeypatch.setenv("ROLLOUT_SIDECAR_URL", "http://env-a:1,http://env-b:2")
    with GenerationClient(transport=transport) as c:
        assert [r.url for r in c.replicas()] == ["http://env-a:1", "http://env-b:2"]


def test_dns_name_is_every_address_and_is_looked_up_again(monkeypatch, fake_time):
    addresses = ["10.0.0.2", "10.0.0.1"]
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses])
    seen = []

    def handler(request):
        seen.append(request.url.host)
        if request.url.host == "10.0.0.1":  # this pod went away
            raise refused("10.0.0.1")
        return httpx.Response(200, json=generated(1))

    with GenerationClient("dns+http://sidecar:8000", retry=FAST,
                          transport=httpx.MockTransport(handler)) as c:
        fake_time.attach(c, "dns+http://sidecar:8000", refresh_s=30)
        assert [r.url for r in c.replicas()] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

        addresses.append("10.0.0.3")  # scaled up: found at the next refresh_s
        fake_time.now += 29
        c.generate(["x"])
        assert len(c.replicas()) == 2
        fake_time.now += 1
        c.generate(["x"])
        assert [r.url for r in c.replicas()][-1] == "http://10.0.0.3:8000"

        # Every replica down: the name is looked up again at once, and the
        # request goes to the address that came back.
        addresses[:] = ["10.0.0.1"]
        fake_time.attach(c, "dns+http://sidecar:8000")
        fake_time.now += 2
        addresses[:] = ["10.0.0.4"]
        seen.clear()
        assert c.generate(["x"]).weight_version == 1
        assert seen[0] == "10.0.0.1" and seen[-1] == "10.0.0.4"
        assert [r.url for r in c.replicas()] == ["http://10.0.0.4:8000"]


# -------------------------------------------------------------- load spreading


def test_sequential_requests_alternate_between_idle_replicas():
    fleet = Fleet(a=1, b=1)
    with fleet.client() as c:
        for _ in range(10):
            c.generate(["x"])
    assert fleet.hosts() == {"a": 5, "b": 5}


def test_a_slow_replica_gets_fewer_requests():
    """4 concurrent workers; replica a holds every request until b has served
    12. Fewest-outstanding routing can give a at most 2 of them meanwhile
    (a 3rd would need b to hold 2 as well: 5 requests from 4 workers)."""
    served = Counter()
    b_done = asyncio.Event()

    async def handler(request):
        host = request.url.host
        served[host] += 1
        if host == "a":
            await b_done.wait()
        elif served["b"] >= 12:
            b_done.set()
        return httpx.Response(200, json=generated(1))

    async def run():
        issued = 0

        async def worker(c):
            nonlocal issued
            while issued < 16:
                issued += 1
                await c.generate(["x"])

        async with AsyncGenerationClient([url("a"), url("b")], retry=FAST,
                                         transport=httpx.MockTransport(handler)) as c:
            await asyncio.gather(*(worker(c) for _ in range(4)))
            return c.replicas()

    replicas = asyncio.run(run())
    assert served["a"] <= 2 and served["b"] >= 14
    assert [r.outstanding for r in replicas] == [0, 0]


def test_threads_share_one_sync_client():
    fleet = Fleet(a=1, b=1, c=1)
    with fleet.client() as c, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: c.generate(["x"]), range(60)))
        assert sum(fleet.hosts().values()) == 60 and len(fleet.hosts()) == 3
        assert all(r.outstanding == 0 for r in c.replicas())


# ------------------------------------------------------------ weight versions


def test_min_weight_version_never_goes_to_a_replica_known_to_be_behind():
    fleet = Fleet(a=3, b=2, c=3)
    with fleet.client() as c:
        for _ in range(3):
            c.info()  # one per replica: each replica's version is now known
        assert [r.weight_version for r in c.replicas()] == [3, 2, 3]
        for _ in range(12):
            assert c.generate(["x"], min_weight_version=3).weight_version == 3
    assert fleet.hosts() == {"a": 6, "c": 6}


def test_no_replica_known_to_hold_it_goes_to_the_highest_known_version():
    fleet = Fleet(a=2, b=1)
    with fleet.client() as c:
        c.generate(["x"]), c.generate(["x"])  # learn: a=2, b=1
        fleet.versions["a"] = 3  # the push reaches a; the client does not know yet
        fleet.calls.clear()
        assert c.generate(["x"], min_weight_version=3).weight_version == 3
    assert fleet.hosts() == {"a": 1}


def test_a_replica_that_refuses_a_version_it_seemed_to_hold_is_forgotten():
    fleet = Fleet(a=3, b=3)
    with fleet.client() as c:
        c.info(), c.info()
        fleet.versions["a"] = 0  # a restarted on its checkpoint
        for _ in range(4):
            assert c.generate(["x"], min_weight_version=3).weight_version == 3
        assert [r.weight_version for r in c.replicas()] == [None, 3]
    assert fleet.hosts() == {"a": 1, "b": 4}


def test_version_409_tries_each_other_replica_once_then_raises():
    fleet = Fleet(a=2, b=3, c=2)
    with fleet.client() as c:
        # Nothing known yet: wherever it lands first, it ends on b.
        assert c.generate(["x"], min_weight_version=3).weight_version == 3
        assert fleet.hosts()["b"] == 1
        fleet.calls.clear()
        with pytest.raises(SidecarError) as e:
            c.generate(["x"], min_weight_version=9)
    assert e.value.status == 409 and e.value.field == "min_weight_version"
    assert fleet.hosts() == {"a": 1, "b": 1, "c": 1}


# ------------------------------------------------------------------- failures


def test_connect_error_moves_the_request_to_another_replica(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["a"] = [refused("a")] * 9  # a is gone
    with fleet.client(fake_time) as c:
        for _ in range(5):
            assert c.generate(["x"]).weight_version == 1
        a = c.replicas()[0]
    # a was tried once, then skipped for its backoff (fake time stands still).
    assert fleet.hosts() == {"a": 1, "b": 5} and fake_time.sleeps == []
    assert a.down_for_s > 0 and a.last_error.startswith("ConnectError")


def test_503_retry_after_skips_the_replica_until_it_passes(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["a"] = [unavailable(10)]
    with fleet.client(fake_time, hosts=["b", "a"]) as c:  # a is the first choice
        c.generate(["x"])
        assert fleet.calls == [("a", "/generate"), ("b", "/generate")]
        a = c.replicas()[1]
        assert a.down_for_s == 10 and a.last_error == "HTTP 503"
        for _ in range(4):
            fake_time.now += 2  # 8 s: a still down
            c.generate(["x"])
        assert fleet.hosts() == {"a": 1, "b": 5} and fake_time.sleeps == []
        fake_time.now += 2
        c.generate(["x"]), c.generate(["x"])
    assert fleet.hosts()["a"] == 2  # back once its Retry-After passed


def test_every_replica_down_waits_for_the_earliest_retry_after(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["a"] = [unavailable(5)]
    fleet.script["b"] = [unavailable(2)]
    with fleet.client(fake_time) as c:
        assert c.generate(["x"]).weight_version == 1
    assert fake_time.sleeps == [2]
    assert [h for h, _ in fleet.calls][-1] == "b"


def test_attempts_bound_the_retries_across_replicas(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["a"] = [refused("a")] * 9
    fleet.script["b"] = [refused("b")] * 9
    with fleet.client(fake_time) as c, pytest.raises(httpx.ConnectError):
        c.generate(["x"])
    assert len(fleet.calls) == FAST.attempts


def test_single_replica_retries_with_backoff_and_retry_after(fake_time):
    fleet = Fleet(a=1)
    fleet.script["a"] = [refused("a"), unavailable(3)]
    with fleet.client(fake_time) as c:
        assert c.generate(["x"]).weight_version == 1
    assert len(fleet.calls) == 3
    assert 0 <= fake_time.sleeps[0] <= FAST.backoff_s
    assert fake_time.sleeps[1] == pytest.approx(3)

    fleet.script["a"] = [refused("a")] * 9
    fleet.calls.clear()
    with fleet.client(fake_time) as c, pytest.raises(httpx.ConnectError):
        c.generate(["x"])
    assert len(fleet.calls) == FAST.attempts


def test_other_errors_are_not_retried():
    fleet = Fleet(a=1, b=1)
    fleet.script["a"] = [httpx.Response(400, json={"error": "bad", "field": "prompts"})]
    fleet.script["b"] = list(fleet.script["a"])
    with fleet.client() as c, pytest.raises(SidecarError) as e:
        c.generate(["x"], min_weight_version=1)
    assert e.value.status == 400 and sum(fleet.hosts().values()) == 1


# ---------------------------------------------------------------- session key


def test_a_session_key_sticks_to_one_replica_and_moves_only_while_it_is_down(fake_time):
    fleet = Fleet(a=1, b=1, c=1)
    with fleet.client(fake_time) as c:
        homes = {}
        for key in (f"episode-{i}" for i in range(12)):
            fleet.calls.clear()
            for _ in range(4):
                c.generate(["x"], session_key=key)
                c.generate(["x"])  # unkeyed traffic in between changes nothing
            keyed = [h for h, _ in fleet.calls[::2]]
            assert len(set(keyed)) == 1
            homes[key] = keyed[0]
        assert len(set(homes.values())) > 1  # keys spread over the replicas

        key, home = next(iter(homes.items()))
        fleet.script[home] = [unavailable(10)]
        fleet.calls.clear()
        c.generate(["x"], session_key=key)  # 503 at home: moves
        c.generate(["x"], session_key=key)  # home is down: elsewhere
        assert fleet.calls[0][0] == home and home not in {fleet.calls[1][0], fleet.calls[2][0]}
        fake_time.now += 10
        fleet.calls.clear()
        c.generate(["x"], session_key=key)
        assert fleet.calls == [(home, "/generate")]  # back home


def test_removing_a_replica_moves_only_its_own_keys():
    keys = [f"episode-{i}" for i in range(40)]

    def homes(hosts):
        fleet = Fleet(**{h: 1 for h in hosts})
        with fleet.client() as c:
            for key in keys:
                c.score([[1, 2]], session_key=key)
        return dict(zip(keys, (h for h, _ in fleet.calls), strict=True))

    before, after = homes(["a", "b", "c", "d"]), homes(["a", "b", "d"])
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "c"} and moved


def test_a_session_replica_behind_min_weight_version_is_not_used():
    fleet = Fleet(a=1, b=1)
    with fleet.client() as c:
        c.generate(["x"], session_key="k")
        home = fleet.calls[0][0]
        other = "b" if home == "a" else "a"
        fleet.versions[other] = 2
        c.info(), c.info()  # learn both versions
        fleet.calls.clear()
        c.generate(["x"], session_key="k", min_weight_version=2)
    assert fleet.calls == [(other, "/generate")]


# ---------------------------------------------------------------- readiness


def test_wait_until_ready_counts_replicas(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["b"] = [httpx.Response(503)] * 100
    with fleet.client(fake_time) as c:
        c.wait_until_ready(timeout=5, poll_s=1, min_ready=1)
        with pytest.raises(TimeoutError, match="not ready: http://b:8000"):
            c.wait_until_ready(timeout=5, poll_s=1)
    assert fake_time.sleeps and set(fake_time.sleeps) == {1}


def test_async_wait_until_ready_is_the_same_plan(fake_time):
    fleet = Fleet(a=1, b=1)
    fleet.script["b"] = [refused("b"), httpx.Response(503)]  # ready at the third poll

    async def run():
        async with AsyncGenerationClient([url("a"), url("b")],
                                         transport=httpx.MockTransport(fleet.handler)) as c:
            fake_time.attach(c, [url("a"), url("b")])
            await c.wait_until_ready(timeout=60, poll_s=2)

    asyncio.run(run())
    assert fake_time.sleeps == [2, 2] and fleet.hosts("/ready") == {"a": 3, "b": 3}


def test_both_clients_have_the_same_api():
    for name in ("generate", "score", "info", "wait_until_ready"):
        sync, coro = getattr(GenerationClient, name), getattr(AsyncGenerationClient, name)
        assert inspect.signature(sync) == inspect.signature(coro) and sync.__doc__
        assert inspect.iscoroutinefunction(coro)
    assert "session_key" in inspect.signature(GenerationClient.generate).parameters
    assert "session_key" in inspect.signature(GenerationClient.score).parameters
