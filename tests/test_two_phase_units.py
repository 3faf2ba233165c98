"""Unit tests of the two-phase push state machine (server/weights/push_session.py)
and of the pusher's replica fan-out (trainer/control/replica_admins.py). No engine: the
phases' work is a plain coroutine here, the admin clients fakes; the real
replicas are in tests/e2e/test_replicas.py."""

from __future__ import annotations

import asyncio

import pytest

from rollout_sidecar.protocol.schema import BeginRequest, CommitResponse
from rollout_sidecar.server.errors import PushConflict
from rollout_sidecar.server.weights.push_session import PushFailed, PushSession, PushState
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.errors import WeightPushError

BEGIN = BeginRequest(version=3, transport="gloo", connection_id="c",
                     buckets=[{"index": 0, "nbytes": 4, "params": []}])


def _session():
    failed: list[tuple[str, str]] = []

    async def on_failed(push, reason, outcome):
        failed.append((outcome, reason))

    return PushSession(on_failed), failed


async def _begin(session: PushSession):
    push = session.new_push(BEGIN, "wait", timeout_s=60)
    session.current = push
    return push


def test_prepare_then_commit_runs_each_phase_once():
    async def main():
        session, failed = _session()
        push = await _begin(session)
        deadline0 = push.deadline
        verified, loaded = [], []

        async def verify(p):
            verified.append(p.push_id)
            await asyncio.sleep(0.01)

        async def load(p):
            loaded.append(p.push_id)
            return CommitResponse(weight_version=3, push_id=p.push_id, commit_policy="wait",
                                  timings={})

        # A repeated prepare (a retried HTTP call) waits for the first one.
        a, b = await asyncio.gather(session.prepare(push.push_id, verify, 120),
                                    session.prepare(push.push_id, verify, 120))
        assert a is b is push and push.state is PushState.PREPARED
        assert verified == [push.push_id] and push.deadline > deadline0
        resp = await session.commit(push.push_id, load)
        assert resp.weight_version == 3 and loaded == [push.push_id] and not failed
        assert session.state is PushState.IDLE

    asyncio.run(main())


def test_a_failed_prepare_ends_the_push_and_its_commit_is_refused():
    async def main():
        session, failed = _session()
        push = await _begin(session)

        async def verify(p):
            raise PushFailed("bucket 1 checksum mismatch")

        with pytest.raises(PushConflict, match="checksum mismatch"):
            await session.prepare(push.push_id, verify, 120)
        assert failed == [("failed", "bucket 1 checksum mismatch")]
        with pytest.raises(PushConflict, match="checksum mismatch"):
            await session.commit(push.push_id, lambda p: None)

    asyncio.run(main())


def test_a_prepared_push_can_be_aborted_and_then_never_commits():
    async def main():
        session, failed = _session()
        push = await _begin(session)

        async def verify(p):
            return None

        await session.prepare(push.push_id, verify, 120)
        async with session.lock:
            p = session.require(push.push_id, PushState.RECEIVING, PushState.PREPARED)
            await session.fail(p, "another replica refused the push", outcome="aborted")
        assert failed == [("aborted", "another replica refused the push")]
        with pytest.raises(PushConflict, match="aborted"):
            await session.commit(push.push_id, lambda p: None)

    asyncio.run(main())


class _Admin:
    def __init__(self, url: str, fail: bool) -> None:
        self.base_url, self.fail = url, fail

    def status(self):
        if self.fail:
            raise WeightPushError("server unreachable")
        return self.base_url

    def close(self) -> None:
        pass


def test_replica_admins_names_every_replica_that_failed():
    rs = ReplicaAdmins("http://a:1,http://b:2,http://c:3", token=None)
    rs.admins = [_Admin("http://a:1", False), _Admin("http://b:2", True),
                 _Admin("http://c:3", True)]
    assert [type(r) for r in rs.each(lambda a, i: a.status())] == [str, WeightPushError,
                                                                   WeightPushError]
    with pytest.raises(WeightPushError, match=r"2 of 3 replicas: http://b:2: .*http://c:3"):
        rs.all(lambda a, i: a.status(), "status")
