"""Who stages a push where (server/weights/staging_layout.py), from what each
worker reports of its host (worker/host_share.py). No engine starts: the
reports are written here; the real TP=2 servers under a small /dev/shm are
tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from rollout_sidecar.server.weights.staging_layout import (
    GIB,
    MIB,
    StagingDoesNotFit,
    WorkerHost,
    need_bytes,
    plan,
)

MODEL = 3 * GIB  # a staged copy
ROOM = 8 * GIB


def hosts(layout: list[tuple[str, int]], tp: int, dp: int = 1) -> list[WorkerHost]:
    """Workers of `dp` engines of `tp` ranks each, placed on `layout`'s
    (shm id, free bytes) in rank order: one entry per worker."""
    assert len(layout) == tp * dp
    return [WorkerHost(rank=r, dp_index=r // tp, host=f"node-{shm}", shm=shm, shm_free=free,
                       shm_total=16 * GIB) for r, (shm, free) in enumerate(layout)]


def test_workers_that_see_one_roomy_shm_share_one_copy_and_the_first_receives():
    layout = plan(hosts([("a", ROOM)] * 4, tp=4), None, False, MODEL)
    assert layout.shared and layout.ranks == 1 and not layout.warnings
    roles = layout.roles()
    assert roles["0"] == {"plane_rank": 0, "leader": 0, "shared": True}
    assert all(roles[str(r)] == {"plane_rank": None, "leader": 0, "shared": True}
               for r in (1, 2, 3))


def test_a_shm_without_room_for_the_copy_stages_per_worker_and_says_what_to_set():
    free = 512 * MIB
    layout = plan(hosts([("a", free)] * 2, tp=2), None, False, MODEL)
    assert not layout.shared and layout.ranks == 2
    assert [r["plane_rank"] for r in layout.roles().values()] == [0, 1]
    (warning,) = layout.warnings
    # The size needed, the room there, and every setting that gives it.
    for said in ("/dev/shm on node-a has 512 MiB free of 16.00 GiB",
                 f"needs {need_bytes(MODEL) / GIB:.2f}", "SHM_SIZE", "--shm-size",
                 "shm.sizeLimit", "2 x 3.00 GiB",
                 "ROLLOUT_SIDECAR_SHARE_HOST_STAGING=false"):
        assert said in warning, (said, warning)


def test_required_sharing_that_does_not_fit_refuses_to_start_naming_the_fix():
    with pytest.raises(StagingDoesNotFit, match=r"give /dev/shm at least \d+ GiB .*SHM_SIZE"):
        plan(hosts([("a", 512 * MIB)] * 2, tp=2), True, False, MODEL)
    assert plan(hosts([("a", ROOM)] * 2, tp=2), True, False, MODEL).shared


def test_sharing_turned_off_or_device_staging_stage_per_worker_without_a_warning():
    for share, device in ((False, False), (None, True), (True, True)):
        layout = plan(hosts([("a", ROOM)] * 2, tp=2), share, device, MODEL)
        assert (layout.shared, layout.ranks, layout.warnings) == (False, 2, [])


def test_an_engine_across_two_hosts_shares_per_host_with_a_leader_on_each():
    """vLLM keeps nnodes_within_dp at 1 under Ray even across hosts: the
    workers' /dev/shm, not vLLM's node count, says who shares."""
    layout = plan(hosts([("a", ROOM), ("a", ROOM), ("b", ROOM), ("b", ROOM)], tp=4), None,
                  False, MODEL)
    assert layout.ranks == 2 and layout.leaders == [0, 2]
    roles = layout.roles()
    assert [roles[str(r)]["leader"] for r in range(4)] == [0, 0, 2, 2]
    assert [roles[str(r)]["plane_rank"] for r in range(4)] == [0, None, 1, None]


def test_one_host_out_of_room_stages_per_worker_while_the_other_shares():
    layout = plan(hosts([("a", ROOM), ("a", ROOM), ("b", MIB), ("b", MIB)], tp=4), None,
                  False, MODEL)
    assert [r["plane_rank"] for r in layout.roles().values()] == [0, None, 1, 2]
    assert len(layout.warnings) == 1 and "node-b" in layout.warnings[0]


def test_two_engines_on_one_host_share_one_copy_each():
    layout = plan(hosts([("a", 2 * ROOM)] * 4, tp=2, dp=2), None, False, MODEL)
    assert layout.leaders == [0, 2]
    assert [r["leader"] for r in layout.roles().values()] == [0, 0, 2, 2]


def test_a_worker_alone_on_its_shm_or_without_one_receives_for_itself():
    layout = plan([WorkerHost(0, 0, "n", None, 0, 0), WorkerHost(1, 0, "n", None, 0, 0)],
                  None, False, MODEL)
    assert layout.ranks == 2 and "no /dev/shm" in layout.warnings[0]
    single = plan(hosts([("a", ROOM)], tp=1), None, False, MODEL)
    assert (single.ranks, single.shared, single.warnings) == (1, False, [])


def test_the_shm_id_is_the_mount_two_tmpfs_on_one_host_differ(tmp_path, monkeypatch):
    """Workers share exactly when they see the same /dev/shm: same boot, same
    mount. A private tmpfs (another container's /dev/shm) is another id."""
    from rollout_sidecar.server.weights.worker import host_share

    here = host_share.host_view()
    assert here["shm"] is not None and here["shm_total"] >= here["shm_free"] > 0
    assert host_share.host_view()["shm"] == here["shm"]
    if os.geteuid() != 0:
        pytest.skip("a private tmpfs needs root (unshare -m)")
    probe = ("from rollout_sidecar.server.weights.worker.host_share import host_view; "
             "print(host_view()['shm'], host_view()['shm_total'])")
    out = subprocess.run(["unshare", "-m", "sh", "-c",
                          "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" -c \"$1\"",
                          os.sys.executable, probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    other, total = out.stdout.split()
    assert other != here["shm"] and int(total) == 64 * MIB
    # Same boot: the part before the device number is the host's.
    assert other.split(":")[0] == here["shm"].split(":")[0]
    monkeypatch.setattr(host_share, "SHM", tmp_path / "none")
    assert host_share.host_view()["shm"] is None


def test_a_leader_on_a_host_without_the_servers_directory_makes_and_holds_it(tmp_path,
                                                                             monkeypatch):
    """A multi-node engine: the API process made the server's directory on
    its own host only; the leader on another host makes one there, held like
    the API process's (a later server removes it once nobody holds it)."""
    from rollout_sidecar.server.weights.worker import host_share
    from rollout_sidecar.server.weights.worker_requests import Layout

    monkeypatch.setattr(host_share, "SHM", tmp_path)
    roles = {"0": {"plane_rank": 0, "leader": 0, "shared": True},
             "1": {"plane_rank": None, "leader": 0, "shared": True}}
    leader = host_share.StagingRole.assigned(Layout(roles, "b"), 0)
    follower = host_share.StagingRole.assigned(Layout(roles, "b"), 1)
    root = tmp_path / "rollout-sidecar-b"
    assert leader.directory == follower.directory == root / "g0"
    assert (root / host_share.StagingRoot.LOCK).exists() and not leader.follows
    assert follower.follows and follower.buffers("staging").leader is False
    assert not host_share._unowned(root)  # held while the leader lives
    again = host_share.StagingRole.assigned(Layout(roles, "b"), 0)
    assert again.directory == leader.directory  # a second leader there adopts it as is
    leader.root.remove()
    alone = host_share.StagingRole.assigned(
        Layout({"0": {"plane_rank": 3, "leader": 0, "shared": False}}, "b"), 0)
    assert (alone.plane_rank, alone.directory, alone.buffers("staging")) == (3, None, None)


def test_room_a_sparse_segment_already_claims_is_not_free(tmp_path, monkeypatch):
    """vLLM's message queues are sparse files that fill as they go round: a
    staged copy must not count on their holes."""
    from types import SimpleNamespace

    from rollout_sidecar.server.weights.worker import host_share

    monkeypatch.setattr(host_share, "SHM", tmp_path)
    with open(tmp_path / "psm_sparse", "wb") as f:
        f.truncate(256 * MIB)  # claimed, holding nothing yet
    (tmp_path / "dense").write_bytes(b"x" * MIB)  # held: the filesystem counts it
    assert host_share._claimed(tmp_path) == 256 * MIB
    # The filesystem says 1 GiB free (the dense file already taken off).
    monkeypatch.setattr(host_share.os, "statvfs", lambda _: SimpleNamespace(
        f_bavail=GIB // 4096, f_blocks=2 * GIB // 4096, f_frsize=4096))
    assert host_share.host_view()["shm_free"] == GIB - 256 * MIB
    (tmp_path / "psm_huge").open("wb").truncate(2 * GIB)  # claims more than is free
    assert host_share.host_view()["shm_free"] == GIB - 256 * MIB - 2 * GIB
