"""How a headless host tells node 0's store (server/engine/headless.py,
`HeadWatch`): the same one across polls, a new one on the same port (node 0
restarted: rejoin), none for longer than gone_s (exit), and a poll that
returns in bounded time when the port refuses, or accepts and never answers
(torch's own client waits forever on that one). Real torch TCPStores in this
process, short timings; no vLLM.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from rollout_sidecar.server.engine.headless import KEY_PREFIX, Head, HeadWatch

pytestmark = pytest.mark.timeout(60)
GONE_S = 1.5
TIMEOUT_S = 0.5
POLL_S = 0.1
# What tells a hang from a poll (a refused connect, or one answer waited on for
# TIMEOUT_S): far above either, so a loaded machine never trips it.
POLL_BOUND_S = 10.0


def _store(port: int = 0) -> TCPStore:
    """node 0's store: a master, as torch.distributed's tcp:// rendezvous starts it."""
    return TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10),
                    wait_for_workers=False, multi_tenant=True)


def _watch(port: int) -> HeadWatch:
    return HeadWatch("127.0.0.1", port, node_rank=1, gone_s=GONE_S, timeout_s=TIMEOUT_S)


def _timed_poll(watch: HeadWatch) -> Head:
    start = time.monotonic()
    verdict = watch.poll()
    took = time.monotonic() - start
    assert took < POLL_BOUND_S, (verdict, took)
    return verdict


def _polls_until(watch: HeadWatch, want: Head, within_s: float) -> list[Head]:
    """Poll every POLL_S until `want` (the verdicts seen), failing after `within_s`."""
    seen: list[Head] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        seen.append(_timed_poll(watch))
        if seen[-1] is want:
            return seen
        time.sleep(POLL_S)
    raise AssertionError(f"no {want} within {within_s}s: {seen}")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_store_is_the_same_head_and_only_gains_this_hosts_key():
    store = _store()
    before = store.num_keys()
    watch = _watch(store.port)
    verdicts = [_timed_poll(watch) for _ in range(5)]
    assert verdicts == [Head.SAME] * 5
    assert watch.key.startswith(f"{KEY_PREFIX}/1/")
    assert store.check([watch.key])
    assert store.num_keys() == before + 1  # nothing else set, nothing counted
    other = _watch(store.port)  # another host's (or this host's next) key is its own
    assert other.key != watch.key and _timed_poll(other) is Head.SAME


def test_a_new_store_on_the_same_port_within_gone_s_is_a_restart():
    store = _store()
    port = store.port
    watch = _watch(port)
    assert _timed_poll(watch) is Head.SAME
    del store  # node 0 stops: its store with it
    assert _timed_poll(watch) is Head.SILENT  # down, for less than gone_s
    store = _store(port)  # node 0 is back, a new store, before gone_s
    assert _timed_poll(watch) is Head.RESTARTED
    assert not store.check([watch.key])


def test_a_store_gone_for_longer_than_gone_s_is_gone():
    store = _store()
    watch = _watch(store.port)
    assert _timed_poll(watch) is Head.SAME
    start = time.monotonic()
    del store
    seen = _polls_until(watch, Head.GONE, within_s=GONE_S + 2 * POLL_BOUND_S)
    assert set(seen[:-1]) == {Head.SILENT}, seen
    assert time.monotonic() - start > GONE_S


def test_a_refused_port_returns_at_once_and_is_gone_after_gone_s():
    watch = _watch(_closed_port())
    start = time.monotonic()
    assert _timed_poll(watch) is Head.SILENT
    _polls_until(watch, Head.GONE, within_s=GONE_S + 2 * POLL_BOUND_S)
    assert time.monotonic() - start > GONE_S


def test_a_port_that_accepts_and_never_answers_does_not_hang_a_poll():
    """torch's client would wait on it forever: one question in flight, waited
    on TIMEOUT_S a poll, and the port counts as not answering."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()[0]),
                                daemon=True)
    acceptor.start()
    watch = _watch(listener.getsockname()[1])
    try:
        seen = _polls_until(watch, Head.GONE, within_s=GONE_S + 2 * POLL_BOUND_S)
        assert set(seen[:-1]) == {Head.SILENT}, seen
        assert sum(t.name == "rollout-sidecar-head-watch" for t in threading.enumerate()) == 1
    finally:
        acceptor.join(5)
        for s in [*accepted, listener]:
            s.close()
    # The question in flight ends once the port is closed (no thread left behind).
    deadline = time.monotonic() + 10
    while any(t.name == "rollout-sidecar-head-watch" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the head watch's question outlived its port"
        time.sleep(0.1)
