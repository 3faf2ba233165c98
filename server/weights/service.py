"""One push at a time: connect, begin, (buckets), commit or abort.

The model changes in exactly one place, `_commit`, and only after every bucket
arrived and matched its checksum. Everything else that can go wrong (a bad
manifest, a dead trainer, a deadline) ends the push while the previous version
keeps serving, and the reason is kept for the pusher and for /weights/status.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sidecar.client.schema import (
    BeginRequest,
    BeginResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    LastPush,
    ProbeRequest,
    ProbeResult,
    TensorInfo,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.server.engine import BadRequest
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.server.weights.reload import UNTOUCHED

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.5
# NCCL needs a GPU on the server; gloo (host memory) and HTTP work everywhere,
# including one GPU shared by trainer and server.
TRANSPORTS = ["gloo", "nccl", "http"] if torch.cuda.is_available() else ["gloo", "http"]


class PushConflict(Exception):
    """409: the push cannot proceed (another push, stale version, failed push)."""


@dataclass
class _Push:
    push_id: str
    req: BeginRequest
    started: float
    deadline: float
    watchdog: asyncio.Task | None = None
    failed: str | None = None


class WeightService:
    def __init__(self, engine: Any, settings: Any, metrics: Any, on_broken: Any) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.on_broken = on_broken  # called if a load fails and the weights are unknown
        self.store: Any = None
        self.store_port = settings.data_plane_port
        self.connection: str | None = None
        self.push: _Push | None = None
        self.last: LastPush | None = None
        self.last_probe: ProbeResult | None = None
        self._lock = asyncio.Lock()

    @property
    def bind_host(self) -> str:
        return self.settings.data_plane_host or self.settings.host

    @property
    def llm(self) -> Any:
        return self.engine.llm

    async def start(self) -> None:
        # The server hosts the rendezvous store: trainers come and go, it stays.
        self.store = torch.distributed.TCPStore(
            self.bind_host, self.settings.data_plane_port, is_master=True,
            wait_for_workers=False, timeout=datetime.timedelta(seconds=60),
        )
        self.store_port = self.store.port

    async def stop(self) -> None:
        if self.push is not None:
            await self._fail(self.push, "server shutting down", outcome="aborted")
        self.store = None

    def status(self) -> WeightStatus:
        gate, info = self.engine.gate, self.engine.info
        return WeightStatus(
            weight_version=gate.version, dtype=info.dtype, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, push_in_progress=self.push is not None,
            connected=self.connection, data_plane_port=self.store_port, transports=TRANSPORTS,
            last_push=self.last, last_probe=self.last_probe,
            suspect=gate.suspect.get(gate.version),
        )

    def index(self) -> WeightIndex:
        idx, serve = self.engine.index, self.engine.info.dtype
        return WeightIndex(
            tensors={n: TensorInfo(shape=list(t.shape), dtype=idx.push_dtype(t, serve))
                     for n, t in idx.tensors.items()},
            ignored=sorted(idx.ignored), tie_word_embeddings=idx.tie_word_embeddings)

    # -------------------------------------------------------------- verify

    async def verify(self, req: ProbeRequest) -> ProbeResult:
        """Score the trainer's probe under the served version and record the gap."""
        gate = self.engine.gate
        if req.version != gate.version:
            raise PushConflict(f"version {req.version} is not the served one ({gate.version})")
        if len(req.trainer_logprobs) != len(req.token_ids) - 1:
            raise BadRequest(f"trainer_logprobs has {len(req.trainer_logprobs)} values; "
                             f"{len(req.token_ids) - 1} expected (one per token after the "
                             "first)", "trainer_logprobs")
        served = torch.tensor(await self.engine.score(req.token_ids, req.version),
                              dtype=torch.float64)
        gap = (served - torch.tensor(req.trainer_logprobs, dtype=torch.float64)).abs()
        mean, worst = gap.mean().item(), gap.max().item()
        passed = bool(mean <= req.tolerance)  # NaN compares False: a NaN gap fails
        result = ProbeResult(version=req.version, mean_abs_dlogp=mean, max_abs_dlogp=worst,
                             tolerance=req.tolerance, passed=passed, tokens=len(gap))
        self.last_probe = result
        self.metrics.probe_gap.labels("mean").set(mean)
        self.metrics.probe_gap.labels("max").set(worst)
        self.metrics.probes.labels("passed" if passed else "failed").inc()
        if passed:
            gate.suspect.pop(req.version, None)
        else:
            gate.suspect[req.version] = (
                f"weight_version {req.version} is suspect: the trainer's probe found mean "
                f"|dlogp| {mean:.3g} > tolerance {req.tolerance:.3g}")
            log.error("%s (max %.3g over %d tokens)", gate.suspect[req.version], worst,
                      len(gap))
        self.metrics.suspect.set(int(gate.version in gate.suspect))
        return result

    # ------------------------------------------------------------ connect

    async def connect(self, req: ConnectRequest) -> ConnectResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with self._lock:
            if self.push is not None:
                raise PushConflict("a push is in progress; connect after it ends")
            host = self.bind_host
            info = dict(store_host="127.0.0.1" if host in ("0.0.0.0", "::") else host,
                        store_port=self.store_port, group_name=f"rs/{req.connection_id}/",
                        backend=req.backend, timeout_s=req.timeout_s)
            self.connection = None
            # Blocks until the trainer joins the group from its side.
            await asyncio.wait_for(
                self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                req.timeout_s,
            )
            self.connection = req.connection_id
            return ConnectResponse(connection_id=req.connection_id, backend=req.backend)

    # -------------------------------------------------------------- begin

    async def begin(self, req: BeginRequest) -> BeginResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._lock:
            if self.push is not None:
                raise PushConflict(f"push {self.push.push_id} (version "
                                   f"{self.push.req.version}) is in progress")
            if req.version <= self.engine.gate.version:
                raise PushConflict(f"version {req.version} is not newer than the served "
                                   f"version {self.engine.gate.version}")
            if req.transport != "http" and self.connection is None:
                raise PushConflict("data plane not connected: POST /weights/connect first")
            check_manifest(req, self.engine.index, self.engine.info.dtype)
            manifest = [b.model_dump() for b in req.buckets]
            op = "prepare" if req.transport == "http" else "receive"
            await self.llm.start_weight_update()
            try:
                await self.llm.update_weights(WeightTransferUpdateRequest(
                    update_info={"op": op, "manifest": manifest}))
            except Exception as e:
                self._lost_connection()
                raise PushConflict(f"could not start the receive: {e}") from e
            now = time.monotonic()
            push = _Push(uuid.uuid4().hex, req, now, now + self.settings.push_timeout_s)
            push.watchdog = asyncio.create_task(self._watch(push))
            self.push = push
            return BeginResponse(push_id=push.push_id, deadline_s=self.settings.push_timeout_s)

    async def _watch(self, push: _Push) -> None:
        """Ends a push whose trainer died or stalled, so the gate never stays shut."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        while self.push is push:
            await asyncio.sleep(POLL_INTERVAL_S)
            if self.push is not push:
                return
            if time.monotonic() > push.deadline:
                await self._fail(push, f"deadline of {self.settings.push_timeout_s:.0f}s passed")
                return
            if push.req.transport == "http":
                continue
            try:
                await self.llm.update_weights(WeightTransferUpdateRequest(
                    update_info={"op": "poll"}))
            except Exception as e:
                await self._fail(push, str(e), session_ended=True)
                return

    # ------------------------------------------------------------- bucket

    async def stage_bucket(self, push_id: str, index: int, data: bytes, checksum: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        push = self._current(push_id)
        if push.req.transport != "http":
            raise PushConflict("this push uses the distributed data plane, not HTTP")
        # Off the event loop: a 256 MiB bucket takes ~60 ms to checksum.
        if await asyncio.to_thread(zlib.crc32, data) != checksum:
            await self._fail(push, f"bucket {index} checksum mismatch over HTTP")
            raise PushConflict(self.last.reason if self.last else "checksum mismatch")
        try:
            await self.llm.update_weights(WeightTransferUpdateRequest(
                update_info={"op": "stage", "bucket": index, "data": data}))
        except Exception as e:
            await self._fail(push, str(e), session_ended=True)
            raise PushConflict(f"bucket {index} rejected: {e}") from e

    # ------------------------------------------------------------- commit

    async def commit(self, req: CommitRequest) -> CommitResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        push = self._current(req.push_id)
        if push.watchdog is not None:
            push.watchdog.cancel()
        t0 = time.monotonic()
        try:
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info={
                "op": "wait", "checksums": req.checksums,
                "timeout_s": max(0.0, push.deadline - time.monotonic())}))
        except Exception as e:
            await self._fail(push, str(e), session_ended=True)
            raise PushConflict(f"push rejected, version {self.engine.gate.version} still "
                               f"serving: {e}") from e
        t_verified = time.monotonic()
        await self._commit(push)
        t1 = time.monotonic()
        self.metrics.pushes.labels("committed").inc()
        self.metrics.push_seconds.observe(t1 - push.started)
        self.metrics.commit_seconds.observe(t1 - t_verified)
        return CommitResponse(weight_version=push.req.version, timings={
            "transfer_s": t0 - push.started, "verify_s": t_verified - t0,
            "commit_s": t1 - t_verified, "total_s": t1 - push.started})

    async def _commit(self, push: _Push) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        gate = self.engine.gate
        policy = self.settings.commit_policy
        async with gate.committing():
            # pause clears the prefix and KV caches: no stale prefix after the swap.
            await self.llm.pause_generation(mode=policy, clear_cache=True)
            try:
                await self.llm.update_weights(WeightTransferUpdateRequest(
                    update_info={"op": "load"}))
                await self.llm.finish_weight_update(weight_version=str(push.req.version))
            except Exception as e:
                self.push = None
                if UNTOUCHED in str(e):  # refused before any live tensor changed
                    self.last = LastPush(version=push.req.version, outcome="failed",
                                         reason=f"load refused: {e}")
                    self.metrics.pushes.labels("failed").inc()
                    log.warning("push of version %d refused at load: %s; version %d keeps "
                                "serving", push.req.version, e, gate.version)
                    raise PushConflict(f"push rejected, version {gate.version} still "
                                       f"serving: {e}") from e
                self.last = LastPush(version=push.req.version, outcome="failed",
                                     reason=f"load failed: {e}")
                self.on_broken(f"weight load failed mid-commit: {e}")
                raise
            finally:
                await self.llm.resume_generation()
            await gate.publish(push.req.version)
            self.metrics.weight_version.set(push.req.version)
            self.metrics.suspect.set(0)
        self.push = None
        self.last = LastPush(version=push.req.version, outcome="committed")
        log.info("committed weight_version=%d (%s policy)", push.req.version, policy)

    # -------------------------------------------------------------- abort

    async def abort(self, push_id: str, reason: str) -> None:
        await self._fail(self._current(push_id), reason, outcome="aborted")

    async def _fail(self, push: _Push, reason: str, *, session_ended: bool = False,
                    outcome: str = "failed") -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self.push is not push:
            return
        self.push = None
        if push.watchdog is not None and push.watchdog is not asyncio.current_task():
            push.watchdog.cancel()
        if not session_ended:
            try:  # "abort" raises inside the worker, which ends vLLM's update session
                await self.llm.update_weights(WeightTransferUpdateRequest(
                    update_info={"op": "abort"}))
            except Exception:
                pass
        if push.req.transport != "http":
            self._lost_connection()  # the trainer's side of the group is out of step
        self.last = LastPush(version=push.req.version, outcome=outcome, reason=reason)
        self.metrics.pushes.labels(outcome).inc()
        log.warning("push of version %d %s: %s; version %d keeps serving",
                    push.req.version, outcome, reason, self.engine.gate.version)

    def _lost_connection(self) -> None:
        self.connection = None

    def _current(self, push_id: str) -> _Push:
        if self.push is None or self.push.push_id != push_id:
            why = f" ({self.last.outcome}: {self.last.reason})" if self.last else ""
            raise PushConflict(f"push {push_id} is not in progress{why}")
        return self.push
