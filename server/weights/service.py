"""The weight routes' logic: connect, begin, buckets, commit, abort, verify.

State lives in two places: who owns the data plane (data_plane.py) and the
push in progress (push_session.py), both changed only under the session lock.
The commit sequence here is the only place the model changes:

    WAIT (all buckets, CRCs) -> gate shut, drain -> pause -> LOAD -> finish
    -> publish version -> resume -> gate open

With several replicas the trainer splits it in two: `prepare` runs WAIT on
every replica, and only once all of them prepared does it `commit` (the rest)
anywhere; one that fails to prepare makes the trainer abort all of them.

A refusal before LOAD's point of no return leaves the old weights serving; a
failure past it marks the gate broken (503) until a push succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from typing import Any

import torch

from rollout_sidecar.client.protocol import (
    BeginRequest,
    BeginResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    LastPush,
    PrepareRequest,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
    TensorInfo,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.weights.data_plane import DataPlane
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.server.weights.ops import SideOp, WorkerOp
from rollout_sidecar.server.weights.push_session import Push, PushFailed, PushSession, PushState
from rollout_sidecar.server.weights.worker.reload import UNTOUCHED

log = logging.getLogger(__name__)
WATCH_S = 0.5
# NCCL needs a GPU on the server; gloo (host memory) and HTTP work everywhere,
# including one GPU shared by trainer and server.
TRANSPORTS = ["gloo", "nccl", "http"] if torch.cuda.is_available() else ["gloo", "http"]


class WeightService:
    def __init__(self, engine: Any, settings: Any, metrics: Any, boot_id: str) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.boot_id = boot_id
        self.plane = DataPlane(engine.llm, settings)
        self.session = PushSession(self._on_failed)
        self.last_probe: ProbeResult | None = None

    @property
    def llm(self) -> Any:
        return self.engine.llm

    async def _op(self, op: WorkerOp, **info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(
            update_info={"op": op.value, **info}))

    def start(self) -> None:
        self.plane.start()

    async def stop(self) -> None:
        async with self.session.lock:
            p = self.session.current
            if p is not None and p.state is PushState.RECEIVING:
                await self.session.fail(p, "server shutting down", outcome="aborted")
        self.plane.stop()

    # ------------------------------------------------------------ read-only

    def status(self) -> WeightStatus:
        gate, info, p = self.engine.gate, self.engine.info, self.session.current
        return WeightStatus(
            weight_version=gate.version, dtype=info.dtype, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, boot_id=self.boot_id,
            push_state=self.session.state.value, push_in_progress=p is not None,
            push_id=p.push_id if p else None,
            connected=self.plane.owner.id if self.plane.owner else None,
            data_plane_port=self.plane.port, data_plane_ranks=self.engine.info.workers,
            transports=TRANSPORTS,
            push_timeout_s=self.settings.push_timeout_s,
            commit_drain_s=self.settings.commit_drain_s, last_push=self.session.last,
            last_probe=self.last_probe, suspect=gate.suspect.get(gate.version),
            broken=gate.broken)

    def index(self) -> WeightIndex:
        idx, serve = self.engine.index, self.engine.info.dtype
        return WeightIndex(
            tensors={n: TensorInfo(shape=list(t.shape), dtype=idx.push_dtype(t, serve))
                     for n, t in idx.tensors.items()},
            ignored=sorted(idx.ignored), tie_word_embeddings=idx.tie_word_embeddings)

    # -------------------------------------------------------- connect, begin

    async def connect(self, req: ConnectRequest) -> ConnectResponse:
        async with self.session.lock:
            if (p := self.session.current) is not None:
                owner = f" by connection {p.req.connection_id}" if p.req.connection_id else ""
                raise PushConflict(f"push {p.push_id}{owner} is in progress: another trainer "
                                   "is pushing to this server; connect after it ends", 1.0)
            return await self.plane.connect(req)

    async def begin(self, req: BeginRequest) -> BeginResponse:
        async with self.session.lock:
            if (p := self.session.current) is not None:
                raise PushConflict(f"push {p.push_id} (version {p.req.version}) is "
                                   f"{p.state.value}; one push at a time")
            if req.version <= self.engine.gate.version:
                raise PushConflict(f"version {req.version} is not newer than the served "
                                   f"version {self.engine.gate.version}")
            if req.transport != "http":
                self.plane.check_owner(req.connection_id)
            check_manifest(req, self.engine.index, self.engine.info.dtype)
            push = self.session.new_push(req, req.commit_policy or self.settings.commit_policy,
                                         self.settings.push_timeout_s)
            try:
                await self.llm.start_weight_update()
                await self._op(WorkerOp.ALLOCATE if req.transport == "http" else WorkerOp.RECEIVE,
                               manifest=[b.model_dump() for b in req.buckets])
            except Exception as e:  # a raising op already ended vLLM's session
                if req.transport != "http":
                    await self.plane.drop()
                raise PushConflict(f"could not start the receive: {e}") from e
            self.session.current = push
            asyncio.get_running_loop().create_task(self._watch(push))
            return BeginResponse(push_id=push.push_id, deadline_s=self.settings.push_timeout_s,
                                 commit_policy=push.policy)

    async def _watch(self, push: Push) -> None:
        """Ends a push whose trainer died or stalled, so nothing waits forever."""
        while True:
            await asyncio.sleep(WATCH_S)
            async with self.session.lock:
                if self.session.current is not push or push.state is PushState.COMMITTING:
                    return
                if push.state is PushState.VERIFYING:  # bounded by the WAIT op's timeout
                    continue
                if time.monotonic() > push.deadline:
                    phase = "prepared, but not committed" if push.state is PushState.PREPARED \
                        else "not committed"
                    await self.session.fail(push, f"deadline of {self.settings.push_timeout_s:.0f}"
                                            f"s passed: {phase}")
                    return
                if push.distributed and push.state is PushState.RECEIVING:
                    state = await self.plane.side(SideOp.STATE)
                    if state["receive"] == "failed":
                        await self.session.fail(push, f"receive failed: {state['receive_error']}")
                        return

    async def stage_bucket(self, push_id: str, index: int, data: bytes, checksum: int) -> None:
        async with self.session.lock:
            push = self.session.require(push_id, PushState.RECEIVING)
            if push.distributed:
                raise PushConflict("this push uses the distributed data plane, not HTTP")
            # Off the event loop: a 256 MiB bucket takes ~60 ms to checksum.
            if await asyncio.to_thread(zlib.crc32, data) != checksum:
                await self.session.fail(push, f"bucket {index} checksum mismatch over HTTP")
                raise PushConflict(f"bucket {index} checksum mismatch; push {push_id} failed")
            try:
                await self._op(WorkerOp.STAGE, bucket=index, data=data)
            except Exception as e:
                await self.session.fail(push, f"bucket {index} rejected: {e}", session_open=False)
                raise PushConflict(f"bucket {index} rejected: {e}") from e

    # ------------------------------------------------------- commit, abort

    async def prepare(self, req: PrepareRequest) -> PrepareResponse:
        t0 = time.monotonic()
        push = await self.session.prepare(req.push_id, lambda p: self._verify(p, req.checksums),
                                          self.settings.push_timeout_s)
        return PrepareResponse(push_id=push.push_id, deadline_s=self.settings.push_timeout_s,
                               timings={"verify_s": time.monotonic() - t0})

    async def _verify(self, push: Push, checksums: list[int]) -> None:
        """Every bucket arrived and matches its CRC; nothing is loaded."""
        try:
            await self._op(WorkerOp.CHECK, checksums=checksums,
                           timeout_s=max(0.0, push.deadline - time.monotonic()))
        except Exception as e:
            raise PushFailed(f"push rejected, version {self.engine.gate.version} still "
                             f"serving: {e}") from e

    async def commit(self, req: CommitRequest) -> CommitResponse:
        return await self.session.commit(req.push_id, lambda p: self._commit(p, req.checksums))

    async def _commit(self, push: Push, checksums: list[int] | None) -> CommitResponse:
        t0 = time.monotonic()
        if push.prepared is None:  # one call does both phases
            if checksums is None:
                raise PushFailed("commit of a push that was not prepared needs checksums",
                                 session_open=True)
            await self._verify(push, checksums)
        t_verified = time.monotonic()
        gate = self.engine.gate
        async with gate.commit_window(push.policy, self.settings.commit_drain_s) as mode:
            try:
                await self.llm.pause_generation(mode=mode, clear_cache=True)
                await self._load(push)
                self.engine.freeze_finished()
                await gate.publish(push.req.version, mode)
            finally:
                await self.llm.resume_generation()
        self.plane.touch()
        t1 = time.monotonic()
        self.metrics.pushes.labels("committed").inc()
        self.metrics.push_seconds.observe(t1 - push.started)
        self.metrics.commit_seconds.observe(t1 - t_verified)
        self.metrics.weight_version.set(push.req.version)
        self.metrics.suspect.set(0)
        log.info("committed weight_version=%d (%s; gate held %.3fs)", push.req.version, mode,
                 gate.last_hold_s)
        return CommitResponse(
            weight_version=push.req.version, push_id=push.push_id, commit_policy=mode,
            timings={"transfer_s": t0 - push.started, "verify_s": t_verified - t0,
                     "commit_s": t1 - t_verified, "gate_hold_s": gate.last_hold_s,
                     "total_s": t1 - push.started})

    async def _load(self, push: Push) -> None:
        gate, v = self.engine.gate, push.req.version
        try:
            await self._op(WorkerOp.LOAD)  # a raise here has ended vLLM's session
        except Exception as e:
            if UNTOUCHED not in str(e):  # past the point of no return
                gate.broken = (f"the load of weight_version {v} failed mid-commit ({e}); "
                               "the weights are in an unknown state, so /generate answers 503 "
                               "until a push succeeds")
                log.error(gate.broken)
            raise PushFailed(f"push rejected at load, version {gate.version} "
                             f"{'still serving' if gate.broken is None else 'unusable'}: {e}"
                             ) from e
        # Only releases the staging; vLLM keeps its session open if this raises.
        await self.llm.finish_weight_update(weight_version=str(v))

    async def abort(self, push_id: str, reason: str) -> LastPush:
        async with self.session.lock:
            ended = self.session.ended.get(push_id)
            if isinstance(ended, LastPush):
                return ended  # aborting twice is fine
            push = self.session.require(push_id, PushState.RECEIVING, PushState.PREPARED)
            await self.session.fail(push, reason, outcome="aborted")
            return self.session.last

    async def _on_failed(self, push: Push, reason: str, outcome: str, session_open: bool
                         ) -> None:
        if session_open:
            with contextlib.suppress(Exception):  # ABORT raises, which ends the session
                await self._op(WorkerOp.ABORT)
        if push.distributed:  # the trainer's side of the group is out of step
            with contextlib.suppress(Exception):
                await self.plane.drop()
        self.metrics.pushes.labels(outcome).inc()
        log.warning("push of version %d %s: %s; version %d keeps serving", push.req.version,
                    outcome, reason, self.engine.gate.version)

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
