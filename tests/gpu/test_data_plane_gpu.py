"""The weight data plane on CUDA, torch only (no vLLM): the parts of the
server's GPU path a GPU without vLLM can prove. Marked gpu.

Two ranks on one GPU: NCCL refuses two ranks of one communicator on one
device of one host ("Duplicate GPU detected"), and tells hosts apart by
`NCCL_HOSTID` when set (misc/utils.cc, getHostHash), so each process here
gets its own and the pair talks over NCCL's socket transport on loopback,
as two hosts would. With two GPUs the worker takes the second.

- The group formed from a thread that never set a device lands on the
  worker's own device. Needs 2 GPUs (the device is the point).
- A peer killed mid-bucket: the receiving process stays alive and the receive
  fails with a named error within the op timeout, as on gloo.
- The same with a second, long-lived NCCL group in the receiving process
  (vLLM's world group in a worker, FSDP's in a trainer), under PyTorch's
  heartbeat monitor set to kill within seconds: our communicator is not
  PyTorch's, so nothing tells that monitor, and the process lives well past
  its timeout. The control, the same peer death on a `ProcessGroupNCCL` data
  plane (what we had), kills the process (protocol/data_plane/nccl_library.py).
- Device staging: each bucket's CRC is taken in the receive thread as it
  lands, so the check has nothing to copy. One GPU.
- A refused NCCL connect ends at once: rank 0 waits for the replicas in the
  store, where the abort marker reaches it, not in NCCL's bootstrap. One GPU.

Each process has a deadline and dumps its stacks before it (faulthandler).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import threading
import time
import zlib

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
DEADLINE_S = 120
BUCKET = 8 << 20
OP_TIMEOUT_S = 5
ALIVE_AFTER_S = 20  # past the monitor's kill (heartbeat 2 s below) many times over
# PyTorch's NCCL monitor, set to kill within seconds (read by each group's
# constructor): a group-0 monitor that reacts kills the process ~op timeout + 3 s
# after a failed work item.
FAST_KILL = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
             "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
             "TORCH_NCCL_COORD_CHECK_MILSEC": "100", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def _as_host(host_id: str) -> None:
    """This process is a host of its own to NCCL (module docstring); before
    any NCCL init in it."""
    os.environ.update({"NCCL_HOSTID": host_id, "NCCL_SOCKET_IFNAME": "lo",
                       "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                       "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0"})


def _worker_device() -> torch.device:
    return torch.device("cuda", torch.cuda.device_count() - 1)


def _store(port: int, master: bool) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore("127.0.0.1", port, is_master=master,
                                      wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=60))


def _hold_group_0() -> object:
    """A long-lived NCCL group made first, as vLLM's world group is: the
    one whose heartbeat monitor acts on PyTorch's process-wide dump flag."""
    os.environ.update(FAST_KILL)
    store = torch.distributed.HashStore()
    opts = torch.distributed.ProcessGroupNCCL.Options()
    pg = torch.distributed.ProcessGroupNCCL(store, 0, 1, opts)
    flag = torch.ones(1, device=_worker_device())
    pg.allreduce([flag]).wait()
    torch.cuda.synchronize()
    return pg


def _trainer(port: int, plan: str, out: mp.Queue, old_way: bool = False) -> None:
    """Rank 0 on cuda:0: joins from a new thread, as the pusher does."""
    faulthandler.dump_traceback_later(DEADLINE_S - 10, exit=True)
    _as_host("trainer")
    from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group, send_bucket

    torch.cuda.set_device(0)
    if old_way:
        group = _c10d_group(port, 0)
    else:
        group = broadcast_group("127.0.0.1", port, "gpu-test", 0, 2, "nccl", 60,
                                op_timeout_s=OP_TIMEOUT_S, device=torch.device("cuda", 0))
    buf = torch.arange(BUCKET, dtype=torch.int64, device="cuda:0").to(torch.uint8)
    if old_way:
        group.broadcast(buf, 0).wait()
    else:
        send_bucket(group, buf, "broadcast").wait()
    torch.cuda.synchronize()
    out.put(("trainer", "sent"))
    if plan == "die":  # mid-push: the receiver waits for a second bucket that never comes
        os.kill(os.getpid(), signal.SIGKILL)
    send_bucket(group, buf, "broadcast").wait()
    torch.cuda.synchronize()
    group.close()


def _c10d_group(port: int, rank: int) -> object:
    """The data plane as it was: a ProcessGroupNCCL, CleanUpOnly, short timeout."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    opts = torch.distributed.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=OP_TIMEOUT_S)
    prefix = torch.distributed.PrefixStore("old-way", _store(port, master=False))
    return torch.distributed.ProcessGroupNCCL(prefix, rank, 2, opts)


def _worker(port: int, out: mp.Queue, group_0: bool = False, old_way: bool = False) -> None:
    """A server worker whose data-plane threads never set a device themselves:
    the join (as worker/group_membership.py's Joiner does it: that module needs
    vLLM, which this machine lacks) and the receive thread must."""
    faulthandler.dump_traceback_later(DEADLINE_S - 10, exit=True)
    _as_host("worker")
    from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group
    from rollout_sidecar.server.weights.worker.bucket_receive import (
        ReceiveThread,
        receive_broadcast,
        use_device,
    )
    from rollout_sidecar.server.weights.worker.staging import StagedBucket, Staging

    device = _worker_device()
    held = _hold_group_0() if group_0 else None
    if old_way:
        torch.cuda.set_device(device)
        group = _c10d_group(port, 1)
        bufs = [torch.empty(BUCKET, dtype=torch.uint8, device=device) for _ in range(2)]
        error = None
        t0 = time.monotonic()
        try:
            for b in bufs:
                group.broadcast(b, 0).wait(datetime.timedelta(seconds=OP_TIMEOUT_S))
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            error = repr(e)
        out.put(("failed", {"error": error, "after_s": round(time.monotonic() - t0, 1)}))
        time.sleep(ALIVE_AFTER_S)
        out.put(("worker", {"alive": True, "error": error}))
        del held
        return
    joined: dict = {}

    def join() -> None:  # Joiner.run's two steps
        try:
            use_device(device, "nccl")
            joined["group"] = broadcast_group("127.0.0.1", port, "gpu-test", 1, 2, "nccl", 60,
                                              op_timeout_s=OP_TIMEOUT_S, device=device)
        except BaseException as e:  # noqa: BLE001
            joined["error"] = repr(e)

    joiner = threading.Thread(target=join, name="rollout-sidecar-connect")
    joiner.start()
    joiner.join(60)
    if "group" not in joined:
        out.put(("worker", f"join failed: {joined.get('error')}"))
        return
    group = joined["group"]
    buckets = [StagedBucket(i, BUCKET, [], torch.empty(BUCKET, dtype=torch.uint8,
                                                       pin_memory=True)) for i in range(2)]
    seen: dict = {}

    def run(rx: ReceiveThread) -> None:
        seen["default"] = torch.cuda.current_device()  # a new thread's: 0
        try:
            receive_broadcast(rx.group, Staging(buckets), "nccl", device, None)
        finally:
            seen["device"] = torch.cuda.current_device()

    t0 = time.monotonic()
    rx = ReceiveThread(group, run)
    rx.start()
    rx.join(DEADLINE_S - 20)
    failed_after = time.monotonic() - t0
    out.put(("failed", {"error": repr(rx.error) if rx.error else None,
                        "after_s": round(failed_after, 1)}))
    if group_0:  # well past the monitor's timeout
        time.sleep(ALIVE_AFTER_S)
    expect = zlib.crc32(torch.arange(BUCKET, dtype=torch.int64).to(torch.uint8).numpy())
    # Bucket 1's bytes (its CRC field is set only once the next one is under way:
    # a peer that died may fail that next broadcast before it).
    out.put(("worker", {"alive": True, "first_crc_ok": zlib.crc32(
        buckets[0].buffer.numpy()) == expect,
                        "all_crc_ok": all(b.checksum == expect for b in buckets),
                        "error": repr(rx.error) if rx.error else None,
                        "thread_default": seen.get("default"),
                        "thread_device": seen.get("device")}))
    group.close()
    del held


def join_or_kill(procs: list) -> None:
    """Each process ends (its own deadline dumped its stacks) or is killed."""
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()


def _run(plan: str, group_0: bool = False, old_way: bool = False) -> dict:
    """Both processes; what each reported, and the worker's exit code (it
    may die without reporting: the control's SIGABRT)."""
    from tests.conftest import free_port

    port = free_port()
    store = _store(port, master=True)  # the server's rendezvous store
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(port, plan, out, old_way)),
             ctx.Process(target=_worker, args=(port, out, group_0, old_way))]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        deadline = time.monotonic() + DEADLINE_S
        while "worker" not in results and time.monotonic() < deadline:
            try:
                who, what = out.get(timeout=1)
                results[who] = what
            except Exception:  # noqa: BLE001 - queue.Empty: is the worker still there?
                if not procs[1].is_alive():
                    break
    finally:
        join_or_kill(procs)
        del store
    results["worker_exit"] = procs[1].exitcode
    return results


@two_gpus
def test_a_group_joined_from_a_new_thread_sits_on_the_workers_own_device():
    r = _run("finish")
    w = r["worker"]
    assert isinstance(w, dict), w
    # The receive thread started on cuda:0, ran on the worker's, and both buckets arrived whole.
    assert (w["thread_default"], w["thread_device"]) == (0, _worker_device().index), w
    assert w["all_crc_ok"] and w["error"] is None, w
    assert r["worker_exit"] == 0


def test_two_buckets_arrive_whole_over_our_nccl_communicator():
    r = _run("finish")
    w = r["worker"]
    print("nccl push, both buckets:", r)
    assert isinstance(w, dict) and w["all_crc_ok"] and w["error"] is None, r
    assert r["worker_exit"] == 0


def test_an_nccl_peer_killed_mid_push_leaves_the_worker_alive_with_a_named_error():
    r = _run("die")
    w = r["worker"]
    print("nccl peer killed:", r)
    # The trainer dies once its first send completed on its side: over NCCL's
    # socket transport that bucket may still be in flight, so the receive
    # fails in the first bucket or waiting for the second: named, not a hang.
    assert isinstance(w, dict) and w["alive"] and w["error"] is not None, r
    assert "remote error" in w["error"] or "not done within" in w["error"], w
    assert r["failed"]["after_s"] < OP_TIMEOUT_S + 10, r  # bounded by the op timeout
    assert r["worker_exit"] == 0, r


def test_a_peer_death_on_our_group_never_reaches_pytorchs_monitor_of_another_group():
    """The worker holds a long-lived NCCL group (vLLM's world group) under a
    monitor set to kill 2 s after a dump signal; the trainer dies mid-bucket.
    The worker names the failure and is alive 20 s later."""
    r = _run("die", group_0=True)
    print("ours, with group 0 held:", r)
    w = r.get("worker")
    assert isinstance(w, dict) and w["alive"] and w["error"], r
    assert r["worker_exit"] == 0, r


def test_control_the_same_death_on_a_process_group_nccl_kills_the_worker():
    """What the data plane was: a ProcessGroupNCCL with CleanUpOnly. Its
    failed work sets PyTorch's dump flag, and group 0's monitor kills the
    process. Shows the test above can fail."""
    r = _run("die", group_0=True, old_way=True)
    print("control, ProcessGroupNCCL data plane:", r)
    assert "worker" not in r, r  # never reported alive
    assert r["worker_exit"] not in (0, None), r  # killed (SIGABRT: -6)


class _LoopbackGroup:
    """Stands in for the trainer's broadcast (a fake, one process): fills the
    target with a known pattern on its device."""

    def __init__(self) -> None:
        self.sent = 0

    def broadcast(self, target: torch.Tensor):  # noqa: ANN201
        target.copy_(torch.full_like(target, self.sent + 1))
        self.sent += 1
        return self

    def wait(self) -> None:
        torch.cuda.current_stream(torch.device("cuda", 0)).synchronize()


def test_device_staging_checksums_each_bucket_in_the_receive_thread(monkeypatch):
    from rollout_sidecar.server.weights.worker import bucket_receive
    from rollout_sidecar.server.weights.worker.staging import StagedBucket, Staging

    threads = set()
    real = bucket_receive.bucket_check("crc32")

    def seen(fn):  # noqa: ANN001, ANN202
        return lambda *a: threads.add(threading.current_thread().name) or fn(*a)

    # The receive's check, whichever of its functions runs: a whole bucket's
    # value, or the running one over its pieces.
    monkeypatch.setattr(bucket_receive, "bucket_check", lambda name: dataclasses.replace(
        real, compute=seen(real.compute), running=seen(real.running)))
    buckets = [StagedBucket(i, BUCKET, [], torch.empty(BUCKET, dtype=torch.uint8,
                                                       device="cuda:0")) for i in range(3)]
    rx = bucket_receive.ReceiveThread(_LoopbackGroup(), lambda rx: bucket_receive.receive_broadcast(
        rx.group, Staging(buckets, device=torch.device("cuda", 0)), "nccl",
        torch.device("cuda", 0), None))
    rx.start()
    rx.join(60)
    assert rx.error is None
    for i, b in enumerate(buckets):  # computed as it landed, from the device bytes
        assert b.checksum == zlib.crc32(bytes([i + 1]) * BUCKET)
    assert threads == {"rollout-sidecar-recv"}


def test_device_staging_under_sum64_checks_on_the_device_with_no_host_copy(monkeypatch):
    from rollout_sidecar.protocol.data_plane.bucket_check import sum64
    from rollout_sidecar.server.weights.worker import bucket_receive
    from rollout_sidecar.server.weights.worker.staging import StagedBucket, Staging

    pinned = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pinned.append(k) or real_empty(*a, **k)
                        if k.get("pin_memory") else real_empty(*a, **k))
    buckets = [StagedBucket(i, BUCKET, [], real_empty(BUCKET, dtype=torch.uint8,
                                                      device="cuda:0")) for i in range(3)]
    rx = bucket_receive.ReceiveThread(_LoopbackGroup(), lambda rx: bucket_receive.receive_broadcast(
        rx.group, Staging(buckets, device=torch.device("cuda", 0)), "nccl",
        torch.device("cuda", 0), None, "sum64"))
    rx.start()
    rx.join(60)
    assert rx.error is None
    for i, b in enumerate(buckets):
        assert b.checksum == sum64(torch.full((BUCKET,), i + 1, dtype=torch.uint8))
    assert pinned == []  # no host copy to read: the check ran where the bytes are


def _refused_trainer(port: int, out: mp.Queue) -> None:
    """A trainer on NCCL whose only replica refuses the connect (another
    trainer's lease): its rank 0 waits in the store for the replica's rank,
    where the abort marker the trainer writes reaches it."""
    faulthandler.dump_traceback_later(DEADLINE_S - 10, exit=True)
    import time

    from rollout_sidecar.protocol.data_plane.signed_store import group_prefix
    from rollout_sidecar.trainer.control.deadlines import Deadlines
    from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
    from rollout_sidecar.trainer.errors import WeightPushError
    from rollout_sidecar.trainer.transport.distributed import DistributedTransport
    from tests.polling import until

    class Refusing:
        base_url = "http://127.0.0.1:1"

        def connect(self, connection_id: str, *args: object, **kwargs: object) -> None:
            # Rank 0 writes its presence, then waits for the replica's.
            store = _store(port, master=False)
            until(lambda: any(group_prefix(connection_id) in k for k in store.list_keys()),
                  "our join is waiting for the replica")
            raise WeightPushError("another trainer is pushing to this server")

        def disconnect(self, *args: object) -> None:
            pass

        def close(self) -> None:
            pass

    class Status:
        data_plane_ranks, data_plane_port, connected = 1, port, None

    torch.cuda.set_device(0)
    replicas = ReplicaAdmins("http://127.0.0.1:1", token=None,
                             deadlines=Deadlines(stall_s=10.0, join_s=30.0))
    replicas.admins = [Refusing()]
    transport = DistributedTransport(replicas, backend="nccl")
    t0 = time.monotonic()
    try:
        transport.ensure_connected([Status()])
        error = None
    except WeightPushError as e:
        error = str(e)
    failed_s = time.monotonic() - t0
    abandoned = len(transport._abandoned)
    t1 = time.monotonic()
    transport.close()
    out.put({"error": error, "failed_s": round(failed_s, 1), "abandoned": abandoned,
             "close_s": round(time.monotonic() - t1, 1),
             "threads_after_close": sorted(t.name for t in threading.enumerate())})


def test_a_refused_nccl_connect_fails_the_push_at_once_and_the_process_exits_0():
    """A refused connect on NCCL: the push fails naming the refusal within
    seconds (the join ends on the abort marker, as gloo's), nothing is left
    running after close(), and the process exits 0. Before, rank 0 waited
    inside NCCL's bootstrap: the push failed after the stall bound and the
    join outlived close()."""
    from tests.conftest import free_port

    port = free_port()
    store = _store(port, master=True)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_refused_trainer, args=(port, out))
    proc.start()
    try:
        r = out.get(timeout=DEADLINE_S)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        del store
    print("refused nccl connect:", r, "exit", proc.exitcode)
    assert r["error"] and "another trainer is pushing" in r["error"], r
    assert r["failed_s"] < 5 and r["abandoned"] == 0 and r["close_s"] < 5, r
    assert not [t for t in r["threads_after_close"] if "join" in t], r  # no join left
    assert proc.exitcode == 0, (proc.exitcode, r)
