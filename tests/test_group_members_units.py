"""Unit tests of when the trainer's data-plane group is reused
(`DistributedTransport.plan_connect`): only with exactly the replicas it was
formed with. No server: statuses are what `/weights/status` would answer, and
the group a stand-in whose close is counted. A fleet that changes under a real
trainer is tests/e2e/test_catch_up.py's and docs/replicas.md's."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.transport.distributed import DistributedTransport


class _Group:
    closed = 0

    def close(self) -> None:
        self.closed += 1


def _status(held: str | None, ranks: int = 1) -> SimpleNamespace:
    return SimpleNamespace(connected=held, data_plane_ranks=ranks, data_plane_port=29500,
                           capabilities=[], requires=[])


def _formed(t: DistributedTransport, statuses: list[SimpleNamespace]) -> _Group:
    """Connect as a push would (the group's join stood in for): every listed
    replica then holds the connection."""
    r = t.plan_connect(statuses, 1)
    assert r is not None
    group = t.group = _Group()
    t.connection_id = r.connection_id
    for s in statuses:
        s.connected = r.connection_id
    return group


def _fleet(urls: str) -> DistributedTransport:
    return DistributedTransport(ReplicaAdmins(urls, token=None))


def test_the_same_replicas_holding_the_group_reuse_it():
    t = _fleet("http://a:1,http://b:1")
    statuses = [_status(None), _status(None)]
    group = _formed(t, statuses)
    assert t.plan_connect(statuses, 1) is None
    assert t.group is group and group.closed == 0


def test_a_replica_that_left_is_not_in_the_next_group():
    """Three replicas, then C is no longer listed: A and B still hold the
    group, whose ranks include C's; the next push forms a new one of A, B."""
    t = _fleet("http://a:1,http://b:1,http://c:1")
    statuses = [_status(None), _status(None, ranks=2), _status(None)]
    group = _formed(t, statuses)
    first = t.connection_id
    t.replicas.spec = "http://a:1,http://b:1"
    assert t.replicas.refresh()
    again = t.plan_connect(statuses[:2], 1)
    assert again is not None, "reused a group that holds a replica no longer listed"
    assert again.connection_id != first and group.closed == 1 and t.group is None
    assert again.world_size == 1 + 1 + 2 and again.rank_offsets == (1, 2)
    assert t.members == (("http://a:1", 1), ("http://b:1", 2))


def test_a_replica_listed_in_another_place_reconnects():
    """Rank offsets follow the listing order: reordered, the group's ranks are
    no longer the fleet's."""
    t = _fleet("http://a:1,http://b:1")
    statuses = [_status(None), _status(None)]
    _formed(t, statuses)
    t.replicas.spec = "http://b:1,http://a:1"
    assert t.replicas.refresh()
    assert t.plan_connect(statuses[::-1], 1) is not None


def test_a_joiner_that_holds_no_group_makes_every_replica_reconnect():
    t = _fleet("http://a:1")
    statuses = [_status(None)]
    _formed(t, statuses)
    t.replicas.spec = "http://a:1,http://b:1"
    t.replicas.refresh()
    r = t.plan_connect([statuses[0], _status(None)], 1)
    assert r is not None and r.world_size == 3
