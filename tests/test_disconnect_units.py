"""Unit tests of releasing the data plane (POST /weights/disconnect,
server/weights/data_plane.py) and of the pusher's close (trainer side). No
engine: a fake vLLM answers the worker side ops; the real server is in
tests/e2e/test_disconnect.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout_sidecar.protocol.schema import BeginRequest, ConnectRequest, DisconnectRequest
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.weights.data_plane import DataPlane
from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.push_session import PushState
from rollout_sidecar.server.weights.service import WeightService
from rollout_sidecar.trainer import WeightPusher
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.transport.distributed import DistributedTransport

LEASE_S = 3600.0  # a lease that never runs out within a test


class _FakeLLM:
    """The worker side of the data plane: every group joins at once."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(world_size_across_dp=1))
        self.ops: list[str] = []
        self.conn: dict = {"state": "none"}

    async def collective_rpc(self, method, args):
        op, payload = args
        self.ops.append(op)
        if op == SideOp.CONNECT.value:
            self.conn = {"state": "connected", "id": payload["connection_id"]}
        elif op == SideOp.DISCONNECT.value:
            self.conn = {"state": "none"}
        return [{"rank": 0, "ok": True, "connection": self.conn, "receive": "idle",
                 "receive_error": None}]


def _engine(llm: _FakeLLM) -> SimpleNamespace:
    """A fake `Engine` (unit test): what the weight service reads of one."""
    from rollout_sidecar.server.engine.version_gate import VersionGate

    return SimpleNamespace(llm=llm, running=lambda: llm, gate=VersionGate(0),
                           info=SimpleNamespace(workers=1, shared_staging=False))


def _settings(**required: bool):
    return SimpleNamespace(connection_lease_s=LEASE_S, connect_timeout_max_s=10.0,
                           data_plane_host=None, host="127.0.0.1", data_plane_port=0,
                           weight_staging="auto", **{"require_data_plane_secret": False,
                                                     "require_bucket_macs": False, **required})


def _connect(cid: str, trainer: str, takeover: bool = False) -> ConnectRequest:
    return ConnectRequest(connection_id=cid, trainer_id=trainer, takeover=takeover)


def _bye(cid: str, trainer: str | None = None) -> DisconnectRequest:
    return DisconnectRequest(connection_id=cid, trainer_id=trainer)


def test_disconnect_releases_the_plane_so_another_trainer_connects_within_the_lease():
    async def main():
        llm = _FakeLLM()
        plane = DataPlane(llm, _settings())
        await plane.connect(_connect("a", "trainer-a"))
        # Within A's lease, another trainer is refused...
        with pytest.raises(PushConflict, match="another trainer is pushing"):
            await plane.connect(_connect("b", "trainer-b"))
        # ...until A disconnects: the worker drops the group, nobody owns the plane.
        r = await plane.disconnect(_bye("a", "trainer-a"), busy=None)
        assert (r.released, r.connected) == (True, None) and plane.owner is None
        assert llm.ops[-1] == SideOp.DISCONNECT.value
        await plane.connect(_connect("b", "trainer-b"))
        assert plane.owner.id == "b"
        # Idempotent: A's repeated disconnect is a 200 that releases nothing.
        r = await plane.disconnect(_bye("a", "trainer-a"), busy=None)
        assert (r.released, r.connected) == (False, "b") and plane.owner.id == "b"

    asyncio.run(main())


def test_disconnect_refuses_a_connection_that_does_not_own_the_plane_or_is_pushing():
    async def main():
        plane = DataPlane(_FakeLLM(), _settings())
        await plane.connect(_connect("a", "trainer-a"))
        with pytest.raises(PushConflict, match="push p1 .* over connection a"):
            await plane.disconnect(_bye("a", "trainer-a"), busy="push p1 (version 3) is "
                                   "receiving")
        with pytest.raises(PushConflict, match="not connected .*holds a"):
            await plane.disconnect(_bye("nobody"), busy=None)
        with pytest.raises(PushConflict, match="belongs to trainer trainer-a"):
            await plane.disconnect(_bye("a", "trainer-x"), busy=None)
        assert plane.owner.id == "a"  # none of those released it
        await plane.connect(_connect("c", "trainer-c", takeover=True))
        with pytest.raises(PushConflict, match="taken over by c"):
            await plane.disconnect(_bye("a", "trainer-a"), busy=None)
        assert plane.owner.id == "c"

    asyncio.run(main())


def test_a_connection_dropped_by_a_failed_push_or_its_own_reconnect_counts_as_released():
    async def main():
        plane = DataPlane(_FakeLLM(), _settings())
        await plane.connect(_connect("a", "trainer-a"))
        await plane.connect(_connect("a2", "trainer-a"))  # its own trainer rebuilt the group
        r = await plane.disconnect(_bye("a", "trainer-a"), busy=None)
        assert (r.released, r.connected) == (False, "a2")
        await plane.drop()  # a failed push drops the group on both sides
        r = await plane.disconnect(_bye("a2", "trainer-a"), busy=None)
        assert (r.released, r.connected) == (False, None)

    asyncio.run(main())


def test_the_service_refuses_to_disconnect_under_a_push_over_that_connection():
    async def main():
        llm = _FakeLLM()
        svc = WeightService(_engine(llm), scorer=None, settings=_settings(), metrics=None,
                            boot_id="b")
        await svc.connect(_connect("a", "trainer-a"))
        begin = BeginRequest(version=1, transport="gloo", connection_id="a",
                             buckets=[{"index": 0, "nbytes": 4, "params": []}])
        svc.session.current = push = svc.session.new_push(begin, "wait", timeout_s=60)
        with pytest.raises(PushConflict, match=f"push {push.push_id} .* is receiving"):
            await svc.disconnect(_bye("a", "trainer-a"))
        push.state = PushState.IDLE
        svc.session.current = None  # the push ended
        assert (await svc.disconnect(_bye("a", "trainer-a"))).released
        assert svc.plane.owner is None

    asyncio.run(main())


def test_a_push_its_trainer_gave_up_on_ends_at_that_trainers_next_connect():
    """A replica frozen at prepare thaws and prepares a push its trainer
    already aborted elsewhere: the trainer's reconnect ends it, where another
    trainer's connect is still refused (issue 20)."""
    async def main():
        svc = WeightService(_engine(_FakeLLM()), scorer=None, settings=_settings(),
                            metrics=None, boot_id="b")
        failed = []

        async def on_failed(push, reason, outcome):
            failed.append((outcome, reason))
            await svc.plane.drop()  # what the real commit side does for a distributed push
        svc.session._on_failed = on_failed
        await svc.connect(_connect("a", "trainer-a"))
        begin = BeginRequest(version=1, transport="gloo", connection_id="a",
                             buckets=[{"index": 0, "nbytes": 4, "params": []}])
        svc.session.current = push = svc.session.new_push(begin, "wait", timeout_s=60)
        push.state = PushState.PREPARED
        with pytest.raises(PushConflict, match="is in progress"):
            await svc.connect(_connect("x", "trainer-x"))
        assert svc.session.current is push and not failed
        await svc.connect(_connect("a2", "trainer-a"))
        assert failed == [("aborted", "superseded: its trainer connected again")]
        assert svc.session.current is None and svc.plane.owner.id == "a2"

    asyncio.run(main())


class _Admin:
    def __init__(self, url: str, answer: Exception | None) -> None:
        self.base_url, self.answer, self.calls = url, answer, []

    def disconnect(self, connection_id, trainer_id, timeout_s):
        self.calls.append((connection_id, trainer_id))
        if self.answer is not None:
            raise self.answer
        return None

    def close(self) -> None:
        pass


def test_close_disconnects_on_every_replica_and_a_failing_one_does_not_stop_it(caplog):
    replicas = ReplicaAdmins("http://a:1,http://b:2", token=None)
    replicas.admins = [_Admin("http://a:1", None),
                       _Admin("http://b:2", WeightPushError("server unreachable"))]
    t = DistributedTransport(replicas)
    t.connection_id, t.group = "conn", None
    t.close()
    assert [a.calls for a in replicas.admins] == [[("conn", t.trainer_id)]] * 2
    assert t.connection_id is None and "from http://b:2: server unreachable" in caplog.text
    t.close()  # nothing left to release: no call
    assert [len(a.calls) for a in replicas.admins] == [1, 1]


def test_a_pusher_is_a_context_manager_whose_close_survives_a_dead_server():
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    with WeightPusher(dead, admin_token="t", probe=False) as pusher:
        pusher.transport.connection_id = "conn"  # as after a push
    assert pusher.transport.connection_id is None and pusher.transport.group is None
    pusher.close()  # twice is fine


class _NeverJoins(_FakeLLM):
    """A trainer that asked to connect and never joins its group."""

    async def collective_rpc(self, method, args):
        replies = await super().collective_rpc(method, args)
        if args[0] == SideOp.CONNECT.value:
            self.conn = {"state": "connecting", "id": args[1]["connection_id"]}
        return [{**r, "connection": self.conn} for r in replies]


def test_a_trainer_gone_while_joining_frees_the_plane_before_the_join_timeout():
    async def main():
        llm = _NeverJoins()
        plane = DataPlane(llm, _settings())  # the join may take up to 10 s
        calls = []

        async def gone() -> bool:  # its connect request closed after a few polls
            calls.append(1)
            return len(calls) > 3

        with pytest.raises(PushConflict, match="went away before joining"):
            await plane.connect(_connect("a", "trainer-a"), gone)
        assert len(calls) == 4 and llm.ops[-1] == SideOp.DISCONNECT.value
        assert plane.owner is None  # the next trainer connects without a lease to wait out

    asyncio.run(main())


def test_a_silent_owners_lease_is_at_most_its_own_stall_bound():
    async def main():
        plane = DataPlane(_FakeLLM(), _settings())  # an hour-long lease setting
        await plane.connect(ConnectRequest(connection_id="a", trainer_id="trainer-a",
                                           op_timeout_s=15))
        with pytest.raises(PushConflict, match="another trainer is pushing"):
            await plane.connect(_connect("b", "trainer-b"))
        plane.owner.last_active -= 16  # silent past its own 15 s stall bound
        await plane.connect(_connect("b", "trainer-b"))
        assert plane.owner.id == "b"

    asyncio.run(main())


@pytest.mark.parametrize("required, body, field", [
    ({"require_data_plane_secret": True}, {}, "secret"),
    ({"require_bucket_macs": True}, {}, "secret"),
    ({"require_bucket_macs": True}, {"secret": "ab" * 32, "bucket_macs": False}, "bucket_macs"),
])
def test_a_server_that_requires_a_secret_or_tags_refuses_a_connect_without_by_field(
        required, body, field):
    plane = DataPlane(_FakeLLM(), _settings(**required))
    with pytest.raises(BadRequest) as e:
        asyncio.run(plane.connect(ConnectRequest(connection_id="c1", **body)))
    assert e.value.field == field
    assert plane.requires() == [r for r, on in (("data_plane_secret", required.get(
        "require_data_plane_secret")), ("bucket_macs", required.get("require_bucket_macs")))
        if on]


@pytest.mark.parametrize("body", [{"slot_pieces": True},  # fanout broadcast: no relay
                                  {"slot_pieces": True, "fanout": "chain", "backend": "nccl"}])
def test_slot_pieces_are_refused_by_field_where_no_gloo_chain_relays_them(body):
    """Only gloo's chain receives a bucket slot by slot (bucket_pieces.py);
    a connect that asks for it elsewhere is refused before any worker is told."""
    llm = _FakeLLM()
    plane = DataPlane(llm, _settings())
    with pytest.raises(BadRequest) as e:
        asyncio.run(plane.connect(ConnectRequest(connection_id="c1", **body)))
    assert e.value.field == "slot_pieces" and llm.ops == []
