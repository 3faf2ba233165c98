"""Faults around a push: each leaves the last good version serving (or, past
the point of no return, nothing serving until the next push), the next push
succeeds, and no trainer or client is blocked past the deadline.

(A trainer killed mid-push and a bad checksum are in tests/e2e/test_push.py; a
server restart under a long-lived pusher is in test_lifecycle.py.)
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from rollout_sidecar.protocol.data_plane.signed_store import group_prefix
from rollout_sidecar.trainer import WeightPusher, WeightPushError
from tests.polling import until
from tests.reliability.conftest import LEASE_S, served_version

pytestmark = pytest.mark.slow


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=60, **kw,
                         headers={"Authorization": f"Bearer {server.admin_token}"})


def status(server) -> dict:
    return admin(server, "GET", "/weights/status").json()


def push_next(server, trainer, **kw):
    v = served_version(server) + 1
    return trainer.pusher.push(trainer.weights.load(v), version=v, **kw)


def assert_settled(server, version: int) -> None:
    s = status(server)
    assert s["push_state"] == "idle" and s["weight_version"] == version and not s["broken"]
    assert httpx.get(server.url + "/ready").status_code == 200


def test_a_second_trainer_is_refused_while_the_first_pushes(reliable, trainer):
    push_next(reliable, trainer)  # the first trainer owns the data plane
    versions = itertools.count(served_version(reliable) + 1)
    lock, stop, first_ok, second = threading.Lock(), threading.Event(), [], {}

    def first_keeps_pushing() -> None:
        while not stop.is_set():
            with lock:
                v = next(versions)
            first_ok.append(trainer.pusher.push(trainer.weights.load(v), version=v,
                                                probe=False).version)

    t = threading.Thread(target=first_keeps_pushing)
    t.start()
    other = WeightPusher(reliable.url, admin_token=reliable.admin_token, bucket_mb=1,
                         probe=False, lease_wait_s=2 * LEASE_S)
    try:
        with lock:
            v = next(versions)
        other.push(trainer.weights.load(v), version=v)
    except WeightPushError as e:
        second["error"] = str(e)
    finally:
        stop.set()
        t.join(120)
    assert "another trainer is pushing to this server" in second.get("error", ""), second
    assert len(first_ok) >= 2 and first_ok == sorted(first_ok)  # undisturbed
    # Once the first trainer stops (its lease runs out), the second takes over
    # cleanly, and the first, pushing again, waits its turn and succeeds too.
    v = served_version(reliable) + 1
    assert other.push(trainer.weights.load(v), version=v).version == v
    assert push_next(reliable, trainer).version == v + 1
    other.close()
    assert_settled(reliable, v + 1)


def test_a_takeover_is_clean_for_both_trainers(reliable, trainer):
    push_next(reliable, trainer)
    old_connection = trainer.pusher.transport.connection_id
    other = WeightPusher(reliable.url, admin_token=reliable.admin_token, bucket_mb=1,
                         probe=False, takeover=True)
    v = served_version(reliable) + 1  # within the first trainer's lease: taken over
    assert other.push(trainer.weights.load(v), version=v).version == v
    # The first trainer's old connection is refused by name, never left to hang
    # on a group that no longer exists...
    index = admin(reliable, "GET", "/weights/index").json()
    r = admin(reliable, "POST", "/weights/begin", json={
        "version": v + 1, "transport": "gloo", "connection_id": old_connection,
        "buckets": _manifest(index, {})})
    assert r.status_code == 409 and "taken over" in r.json()["error"], r.text
    # ...and its pusher reconnects once the new owner's lease runs out.
    assert push_next(reliable, trainer).version == v + 1
    other.close()
    assert trainer.pusher.transport.connection_id != old_connection
    assert_settled(reliable, v + 1)


def _racing(server, race):
    """An HTTP pusher whose commit runs `race(admin, real_commit, push_id,
    checksums)` in a thread alongside it; `seen` gets both outcomes."""
    pusher = WeightPusher(server.url, admin_token=server.admin_token, transport="http",
                          bucket_mb=1, probe=False)
    admin_client = pusher.replicas.admins[0]
    real_commit, seen = admin_client.commit, {}

    def commit(push_id, checksums, timeout_s, macs=None):
        t = threading.Thread(target=lambda: seen.__setitem__(
            "race", race(admin_client, real_commit, push_id, checksums)))
        t.start()
        try:
            seen["commit"] = real_commit(push_id, checksums, timeout_s, macs)
            return seen["commit"]
        except WeightPushError as e:
            seen["commit_error"] = str(e)
            raise
        finally:
            t.join(60)

    admin_client.commit = commit
    return pusher, seen


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_abort_racing_a_commit_ends_in_one_outcome(reliable, trainer, delay_s):
    def abort(admin_client, real_commit, push_id, checksums):
        time.sleep(delay_s)
        try:
            return ("aborted", admin_client.abort(push_id, "race").outcome)
        except WeightPushError as e:
            return ("refused", str(e))

    v0 = served_version(reliable)
    pusher, seen = _racing(reliable, abort)
    try:
        pusher.push(trainer.weights.load(v0 + 1), version=v0 + 1)
    except WeightPushError:
        pass
    race = seen["race"]
    if "commit" in seen:  # the commit won: the abort was refused, the version moved
        assert race[0] == "refused" and "committ" in race[1], seen
        assert_settled(reliable, v0 + 1)
    else:  # the abort won: the commit says so, the old version serves
        assert race == ("aborted", "aborted") and "aborted" in seen["commit_error"], seen
        assert_settled(reliable, v0)
    v = served_version(reliable)
    assert push_next(reliable, trainer).version == v + 1


def test_a_duplicate_commit_gets_the_same_answer(reliable, trainer):
    v0 = served_version(reliable)
    pusher, seen = _racing(reliable, lambda admin_client, real_commit, push_id, checksums:
                           real_commit(push_id, checksums, 60))
    result = pusher.push(trainer.weights.load(v0 + 1), version=v0 + 1)
    assert result.version == v0 + 1 and seen["race"] == seen["commit"], seen
    assert_settled(reliable, v0 + 1)


def _manifest(index: dict, bad: dict) -> list[dict]:
    """One bucket per tensor, with `bad` applied to the first tensor."""
    out = []
    for i, (name, t) in enumerate(index["tensors"].items()):
        p = {"name": name, "dtype": t["dtype"], "shape": t["shape"], "offset": 0}
        if i == 0:
            p.update(bad)
        n = 4 * math.prod(t["shape"])
        out.append({"index": i, "nbytes": n, "params": [p]})
    return out


@pytest.mark.parametrize("bad, field", [
    ({"name": "model.nope.weight"}, "buckets[0].params[0].name"),
    ({"dtype": "float16"}, "buckets[0].params[0].dtype"),
    ({"shape": [1, 2, 3]}, "buckets[0].params[0].shape"),
])
def test_a_bad_manifest_is_400_naming_the_field(reliable, trainer, bad, field):
    v0 = served_version(reliable)
    index = admin(reliable, "GET", "/weights/index").json()
    r = admin(reliable, "POST", "/weights/begin", json={
        "version": v0 + 1, "transport": "http", "buckets": _manifest(index, bad)})
    assert r.status_code == 400 and r.json()["field"] == field, r.text
    assert_settled(reliable, v0)
    assert push_next(reliable, trainer).version == v0 + 1


def test_a_connect_nobody_joins_does_not_hold_generation(reliable, trainer):
    done = {}

    def ghost() -> None:
        done["r"] = admin(reliable, "POST", "/weights/connect", json={
            "connection_id": "ghost", "timeout_s": 3, "takeover": True})

    t = threading.Thread(target=ghost)
    t.start()
    # The server logs the connect once it waits for the trainer to join.
    until(lambda: "data-plane connect ghost: waiting" in reliable.log.read_text(),
          "the server waiting for the ghost to join")
    with reliable.client() as c:
        r = c.generate(["still serving"], sampling=dict(max_tokens=4))
    answered_while_waiting = t.is_alive()
    t.join(60)
    assert answered_while_waiting and r.results[0].samples[0].token_ids
    # Refused by name, whichever side's bound ran out first (ours or the store's).
    error = done["r"].json()["error"]
    assert done["r"].status_code == 409 and "connect ghost" in error
    assert "did not join" in error or "timeout" in error, error
    v = served_version(reliable)
    assert push_next(reliable, trainer).version == v + 1  # the trainer reconnects
    assert_no_keys_of(reliable, "ghost")


def test_a_trainer_killed_while_joining_frees_the_plane_at_once(reliable, trainer):
    """A trainer process SIGKILLed while the server waits for it to join (its
    connect asked for the longest wait the server allows): the server ends the
    wait because the request's connection closed, not because a timeout ran
    out, and the next trainer's push goes through."""
    ghost = subprocess.Popen(
        [sys.executable, "-c", (
            "import httpx, os; httpx.post(os.environ['URL'] + '/weights/connect', json={"
            "'connection_id': 'killed', 'timeout_s': 600, 'takeover': True}, headers={"
            "'Authorization': 'Bearer ' + os.environ['TOKEN']}, timeout=600)")],
        env=dict(os.environ, URL=reliable.url, TOKEN=reliable.admin_token,
                 PYTHONFAULTHANDLER="1"), start_new_session=True)
    try:
        # Killed once its connect is in: the worker is waiting for it to join.
        deadline = time.monotonic() + 60
        while "data-plane connect killed: waiting" not in _log(reliable):
            assert time.monotonic() < deadline and ghost.poll() is None
            time.sleep(0.1)
    finally:
        ghost.kill()
        ghost.wait(30)
    v = served_version(reliable)
    assert push_next(reliable, trainer).version == v + 1
    assert "data-plane connect killed failed: the trainer went away before joining" in \
        _log(reliable)
    assert_no_keys_of(reliable, "killed")


def assert_no_keys_of(server, connection_id: str) -> None:
    """A failed connect leaves nothing in the rendezvous store: the worker's
    join deletes the connection's keys once it gives up (at the timeout the
    connect asked for, capped by the server's), so a server outliving many
    failed connects does not collect their keys."""
    store = _data_plane_store(server)
    prefix = group_prefix(connection_id)
    until(lambda: not [k for k in store.list_keys() if k.startswith(prefix)],
          f"connection {connection_id}'s rendezvous keys ({prefix}*) deleted")


def _log(server) -> str:
    return server.log.read_text(errors="replace")


def test_a_load_failing_mid_commit_serves_nothing_until_a_push_succeeds(reliable, trainer):
    v0 = served_version(reliable)
    reliable.failpoints.write_text("load.crash")
    try:
        with pytest.raises(WeightPushError, match="unusable"):
            push_next(reliable, trainer)
    finally:
        reliable.failpoints.write_text("")
    s = status(reliable)
    assert s["broken"] and s["weight_version"] == v0
    r = httpx.post(reliable.url + "/generate", json={"prompts": ["x"]},
                   headers={"Authorization": f"Bearer {reliable.api_token}"})
    assert r.status_code == 503 and "failed mid-commit" in r.json()["error"]
    assert httpx.get(reliable.url + "/ready").status_code == 503
    assert push_next(reliable, trainer).version == v0 + 1
    assert_settled(reliable, v0 + 1)
    with reliable.client() as c:
        assert c.generate(["back"], sampling=dict(max_tokens=2)).weight_version == v0 + 1


def _data_plane_store(server):
    """A client of the server's rendezvous store, as anyone who reaches the
    data-plane port could open."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", status(server)["data_plane_port"], is_master=False,
                         timeout=datetime.timedelta(seconds=10))


def _store_at_next_connect(server) -> tuple[threading.Thread, list]:
    """A store client opened now, which the server's store gate holds until
    the next connect opens the store (store_gate.py: a rogue gets in only
    then); the list gets the client once it is in."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_data_plane_store(server)),
                              daemon=True)
    thread.start()
    return thread, box


def test_a_rogue_on_the_data_plane_port_is_named_and_keys_do_not_pile_up(reliable, trainer,
                                                                         monkeypatch):
    """Someone who overwrites every rendezvous key while a push connects (the
    only time the store takes a connection): the push retries under fresh
    ids and secrets, which cuts the rogue off, and either gets through or
    fails naming the tampering, never std::bad_alloc; the old version serves;
    then clean pushes (each reconnecting) leave the store's key count flat.

    The trainer's own join waits (10 s at most) until the rogue has
    overwritten a key, which the server's worker writes as it joins: without
    that, a rendezvous that formed within the rogue's first poll (2 ms) left
    it nothing to see, and the test failed for want of an attack (once in a
    CI run)."""
    from rollout_sidecar.protocol.data_plane.signed_store import TAMPERED
    from rollout_sidecar.trainer.transport import distributed

    stop, hits = threading.Event(), []
    seen = threading.Event()
    join = distributed.broadcast_group

    def join_once_attacked(*args: Any, **kwargs: Any) -> Any:
        seen.wait(10)
        return join(*args, **kwargs)

    monkeypatch.setattr(distributed, "broadcast_group", join_once_attacked)

    def overwrite() -> None:
        rogue = _data_plane_store(reliable)  # held until the push's connect opens the store
        while not stop.is_set():
            try:
                for k in rogue.list_keys():
                    if k.startswith("rs/") and not k.endswith("/abort"):
                        rogue.set(k, b"garbage")
                        hits.append(k)
                        seen.set()
            except Exception:  # noqa: BLE001 - a new connect closed it: the rogue is out
                return
            time.sleep(0.002)

    v = served_version(reliable)
    trainer.pusher.transport.close()  # the next push connects (while the rogue writes)
    thread = threading.Thread(target=overwrite, daemon=True)
    thread.start()
    try:
        try:
            assert push_next(reliable, trainer, probe=False).version == v + 1
            v += 1
        except WeightPushError as e:
            assert TAMPERED in str(e) and "bad_alloc" not in str(e), str(e)
            assert served_version(reliable) == v
    finally:
        stop.set()
        thread.join(30)
    assert hits, "the rogue never saw a rendezvous key"
    keys_after = []
    for _ in range(3):
        trainer.pusher.transport.close()  # a new connection (and rendezvous) per push
        joining, observer = _store_at_next_connect(reliable)
        assert push_next(reliable, trainer, probe=False).version == v + 1
        v += 1
        joining.join(30)
        keys_after.append(set(observer[0].list_keys()))
    # Clean pushes leave no key behind, and the gate sweeps whatever a failed
    # try left (its marker, the rogue's keys) once its connect ended: what a
    # push's observer sees is only keys it wrote, none of ours, never more.
    assert keys_after[-1] <= keys_after[0] <= set(hits), (keys_after, set(hits))
    assert_settled(reliable, v)


def test_a_tampered_bucket_fails_authentication(reliable, trainer):
    """With bucket tags on, a bucket whose bytes are not what the tag covers
    (flipped on rank 0's side of the tag: what arrives differs) fails the
    prepare by name, the old version serves, and the next push succeeds."""
    t = trainer.pusher.transport
    start = t.start_push

    def tampered(version: int) -> None:
        start(version)
        add = t.bucket_macs.add

        def add_flipped(index, buf) -> None:
            if index == 0:
                buf = buf.clone()
                buf[0] ^= 1
            add(index, buf)

        t.bucket_macs.add = add_flipped

    v = served_version(reliable)
    t.authenticate_buckets = True
    t.close()  # reconnect, telling the server this connection tags its buckets
    t.start_push = tampered
    try:
        with pytest.raises(WeightPushError, match="bucket 0 failed authentication"):
            push_next(reliable, trainer, probe=False)
        assert_settled(reliable, v)
        del t.start_push  # the real one again
        assert push_next(reliable, trainer, probe=False).version == v + 1
        # A prepare without the tags, on a connection that promised them: 400 naming it.
        t.bucket_macs = None
        start_push = t.start_push
        t.start_push = lambda version: None
        with pytest.raises(WeightPushError, match="macs"):
            push_next(reliable, trainer, probe=False)
        t.start_push = start_push
        assert_settled(reliable, v + 1)
    finally:
        t.__dict__.pop("start_push", None)
        t.authenticate_buckets = False
        t.close()
