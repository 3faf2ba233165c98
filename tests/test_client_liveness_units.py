"""The process-wide liveness verdict (protocol/calls/liveness.py; issue 26, item 3).

Unit tests with fake servers: each replica is a tiny threaded HTTP server in
this process, on 127.0.0.1 (the project allows fake servers only in unit
tests that say so), so the clients and their shared pinger use httpx's real
default transport. "Frozen" blocks every request the server receives until
it is thawed, as a SIGSTOPped replica leaves its connections unanswered.
The clients run a faster liveness policy than the default; nothing asserts
a duration: a reroute is awaited with a generous deadline. Two real replicas,
one SIGSTOPped, are measured by bench/frozen_replica.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rollout_sidecar.client import AsyncGenerationClient, GenerationClient, LivenessPolicy
from rollout_sidecar.client.liveness_registry import REGISTRY
from rollout_sidecar.client.replica_pool import _weight
from tests import polling
from tests.test_client_routing import generated

LIVE = LivenessPolicy(every_s=0.5, timeout_s=1.0, misses=2, after_s=0.25)
DEADLINE_S = 60.0  # generous: only a broken reroute waits this long
# quiet: a ping answered after LIVE.timeout_s counts as a miss.
pytestmark = pytest.mark.quiet


class FakeReplica:
    """A fake sidecar replica over real HTTP: GET /health, POST /generate
    (taking `generate_s`), each counted by path when it arrives."""

    def __init__(self, version: int = 1, generate_s: float = 0.0) -> None:
        self.version = version
        self.generate_s = generate_s
        self.running = threading.Event()  # cleared: frozen
        self.running.set()
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                replica._arrived(self.path)
                replica.running.wait()
                self._send({"status": "ok"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                replica._arrived(self.path)
                time.sleep(replica.generate_s)
                replica.running.wait()
                self._send(generated(replica.version))

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _arrived(self, path: str) -> None:
        with self._lock:
            self.counts[path] += 1

    def generates(self) -> int:
        with self._lock:
            return self.counts["/generate"]

    def freeze(self) -> None:
        self.running.clear()

    def thaw(self) -> None:
        self.running.set()

    def stop_listening(self) -> None:
        """As a draining server does: new connections are refused, requests
        already received still get their answer."""
        self.server.shutdown()
        self.server.server_close()

    def close(self) -> None:
        self.thaw()  # the abandoned requests end
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def replicas() -> Iterator[Callable[..., list[FakeReplica]]]:
    made: list[FakeReplica] = []

    def make(n: int, **kw: float) -> list[FakeReplica]:
        made.extend(FakeReplica(**kw) for _ in range(n))
        return made[-n:]
    yield make
    for r in made:
        r.close()


def until(condition: Callable[[], bool], what: str) -> None:
    polling.until(condition, what, DEADLINE_S)


def homed_at(home: str, urls: list[str]) -> str:
    """A session key whose replica (rendezvous hashing) is `home`."""
    return next(k for k in (f"episode-{i}" for i in range(1000))
                if max(urls, key=lambda u: _weight(k, u)) == home)


def pingers(url: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"rollout-sidecar-liveness {url}"]


def test_clients_in_one_process_share_one_pinger_and_one_verdict(replicas):
    a, b = replicas(2)
    urls = [a.url, b.url]
    clients = [GenerationClient(urls, liveness=LIVE, stall_timeout_s=None) for _ in range(3)]
    try:
        assert len({id(c._liveness.get(a.url)) for c in clients}) == 1
        assert len(pingers(a.url)) == 1 and len(pingers(b.url)) == 1
        a.freeze()
        # Only the first client ever waits on a; its request moves to b.
        assert clients[0].generate(["x"], session_key=homed_at(a.url, urls)).weight_version == 1
        assert b.generates() == 1
        for c in clients[1:]:  # they never sent a request to a, and know anyway
            assert [r.frozen for r in c.replicas()] == [True, False]
            assert c.replicas()[0].last_error.startswith("frozen: GET /health unanswered")
            for _ in range(3):
                c.generate(["x"])
        assert a.generates() == 1 and b.generates() == 7
    finally:
        for c in clients:
            c.close()


def test_every_client_leaves_a_frozen_replica_and_its_waiting_requests_move(replicas):
    a, b = replicas(2, generate_s=0.01)
    clients = [GenerationClient([a.url, b.url], liveness=LIVE, stall_timeout_s=None)
               for _ in range(4)]
    done, errors = [0] * 4, []
    stop = threading.Event()

    def work(i: int) -> None:
        while not stop.is_set():
            try:
                clients[i].generate(["x"])
                done[i] += 1
            except Exception as e:  # asserted empty below
                errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        until(lambda: min(done) >= 3, "every client served before the freeze")
        assert a.generates() > 0
        a.freeze()
        at_freeze = list(done)
        # Without a stall check (stall_timeout_s=None) a request waiting on a
        # could only end by the shared verdict: every client keeps serving.
        until(lambda: all(d >= f + 5 for d, f in zip(done, at_freeze, strict=True)),
              "every client serving again after the freeze")
        assert all(c.replicas()[0].frozen for c in clients)
        settled = list(done)
        until(lambda: all(d >= s + 3 for d, s in zip(done, settled, strict=True)),
              "more requests while a is frozen")
        sent_to_a = a.generates()
        settled = list(done)
        until(lambda: all(d >= s + 5 for d, s in zip(done, settled, strict=True)),
              "more requests while a is frozen")
        assert a.generates() == sent_to_a, "no request goes to a frozen replica"
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
        for c in clients:
            c.close()
    assert errors == []


def test_a_slow_replica_that_answers_its_ping_keeps_its_long_request(replicas):
    (a,) = replicas(1, generate_s=4 * LIVE.every_s)
    (b,) = replicas(1)
    urls = [a.url, b.url]
    with GenerationClient(urls, liveness=LIVE, stall_timeout_s=None) as c:
        entry = c._liveness.get(a.url)
        pings_before = entry.pings
        assert c.generate(["x"], session_key=homed_at(a.url, urls)).weight_version == 1
        assert entry.pings - pings_before >= 2  # asked while it ran, and it answered
        assert [r.frozen for r in c.replicas()] == [False, False]
        assert c.replicas()[0].last_error is None
    assert a.generates() == 1 and b.generates() == 0, "one try: never sent again"


def test_a_draining_replica_that_refuses_new_connections_keeps_its_request(replicas):
    # A SIGTERMed server closes its listener and finishes what it holds: its
    # pings are refused (not unanswered), so it is not frozen, and neither the
    # shared verdict nor the client's own stall check gives its request up.
    (a,) = replicas(1, generate_s=4 * LIVE.every_s)
    (b,) = replicas(1)
    urls = [a.url, b.url]
    with GenerationClient(urls, liveness=LIVE, stall_timeout_s=LIVE.every_s) as c:
        entry = c._liveness.get(a.url)

        def drain() -> None:
            until(lambda: a.generates() == 1, "the request reached a")
            a.stop_listening()

        draining = threading.Thread(target=drain, daemon=True)
        draining.start()
        pings_before = entry.pings
        assert c.generate(["x"], session_key=homed_at(a.url, urls)).weight_version == 1
        draining.join(DEADLINE_S)
        assert entry.pings - pings_before >= 2  # refused while it ran
        assert not entry.frozen and c.replicas()[0].last_error is None
    assert a.generates() == 1 and b.generates() == 0, "one try: never sent again"


def test_a_replica_that_comes_back_is_used_again(replicas):
    a, b = replicas(2)
    urls = [a.url, b.url]
    key = homed_at(a.url, urls)
    with GenerationClient(urls, liveness=LIVE, stall_timeout_s=None) as c:
        a.freeze()
        c.generate(["x"], session_key=key)  # waits on a, moves to b
        assert c.replicas()[0].frozen and b.generates() == 1
        a.thaw()  # the abandoned request ends on a
        until(lambda: not c.replicas()[0].frozen, "a answers its ping again")
        before = a.generates()
        for _ in range(3):
            c.generate(["x"], session_key=key)
        assert a.generates() == before + 3 and b.generates() == 1


def test_when_every_replica_is_frozen_the_error_names_each(replicas):
    a, b = replicas(2)
    with GenerationClient([a.url, b.url], liveness=LIVE, stall_timeout_s=None) as c, \
            GenerationClient([a.url, b.url], liveness=LIVE, stall_timeout_s=None,
                             timeout=3) as fresh:
        a.freeze(), b.freeze()
        with pytest.raises(httpx.ReadTimeout) as e:  # tried a and b: raised at once
            c.generate(["x"])
        # A fresh request waits up to `timeout` for one to answer, then raises.
        with pytest.raises(httpx.ReadTimeout) as e2:
            fresh.generate(["x"])
    for error in (e.value, e2.value):
        for r in (a, b):
            assert f"{r.url}: frozen: " in str(error)
    assert a.generates() == 1 and b.generates() == 1


def test_closed_or_collected_clients_stop_pinging(replicas):
    (a,) = replicas(1)
    first = GenerationClient(a.url, liveness=LIVE)
    second = GenerationClient(a.url, liveness=LIVE)
    entry = first._liveness.get(a.url)
    assert second._liveness.get(a.url) is entry
    first.close()
    assert entry in REGISTRY.entries() and entry._thread.is_alive()
    second.close()
    assert entry not in REGISTRY.entries()
    entry._thread.join(DEADLINE_S)
    assert not entry._thread.is_alive()

    unclosed = GenerationClient(a.url, liveness=LIVE)
    entry = unclosed._liveness.get(a.url)
    del unclosed
    gc.collect()
    entry._thread.join(DEADLINE_S)
    assert not entry._thread.is_alive() and entry not in REGISTRY.entries()
    assert pingers(a.url) == []


def test_an_async_client_shares_the_verdict_and_moves_its_waiting_request(replicas):
    a, b = replicas(2)
    urls = [a.url, b.url]

    async def main(sync_client: GenerationClient) -> tuple[int, list[bool]]:
        async with AsyncGenerationClient(urls, liveness=LIVE, stall_timeout_s=None) as c:
            assert c._liveness.get(a.url) is sync_client._liveness.get(a.url)
            a.freeze()
            out = await c.generate(["x"], session_key=homed_at(a.url, urls))
            return out.weight_version, [r.frozen for r in sync_client.replicas()]

    with GenerationClient(urls, liveness=LIVE) as sync_client:
        version, frozen = asyncio.run(main(sync_client))
    assert version == 1 and frozen == [True, False]
    assert a.generates() == 1 and b.generates() == 1


def test_an_async_client_with_its_own_transport_pings_through_its_loop():
    frozen_a = asyncio.Event()  # never set: a's /generate never answers

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            if request.url.path == "/generate":
                await frozen_a.wait()
            raise httpx.ReadTimeout("a: no byte")  # its /health: no answer
        return httpx.Response(200, json=generated(1))

    urls = ["http://a:8000", "http://b:8000"]

    async def main() -> tuple[int, bool]:
        async with AsyncGenerationClient(urls, liveness=LIVE, stall_timeout_s=None,
                                         transport=httpx.MockTransport(handler)) as c:
            out = await c.generate(["x"], session_key=homed_at(urls[0], urls))
            return out.weight_version, c.replicas()[0].frozen

    assert asyncio.run(main()) == (1, True)
