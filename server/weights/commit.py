"""The server's side of the two-phase commit: prepare, commit, abort.

The commit sequence here is the only place the model changes:

    CHECK (all buckets, CRCs) [-> PATCH, a delta] -> gate shut, drain -> pause
    -> LOAD -> finish -> publish version -> resume -> gate open

With several replicas the trainer splits it in two: `prepare` runs CHECK (and
a delta's PATCH) on every replica, and only once all of them prepared does it
`commit` (the rest) anywhere; one that fails to prepare makes the trainer
abort all of them. One replica may also `commit` without a prepare: both
phases in one call.

A delta's patches are written into the staged copy in phase 1, not inside
the commit window: they change nothing generation reads, so they need no
drain, no pause and no dropped cache (the engine runs the call between two
steps, as it runs CHECK), and a delta's commit is the load alone, as a dense
one's (a 1% delta's patches took 0.036-0.071 s of its paused commit on 2
cores, bench/push_delta.py). The staged copy then holds neither version
until a load: a push aborted after it makes the next one dense.

A refusal before LOAD's point of no return leaves the old weights serving; a
failure past it marks the gate broken (503) until a push succeeds. Which
transitions are allowed, and their idempotency, is push_session.py's job; this
module is the work each phase does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.schema import (
    CommitRequest,
    CommitResponse,
    DraftOutcome,
    LastPush,
    PrepareRequest,
    PrepareResponse,
)
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine.engine_api import Engine
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.data_plane import DataPlane
from rollout_sidecar.server.weights.manifest_check import carries_draft
from rollout_sidecar.server.weights.ops import WorkerCallFailed, WorkerOp
from rollout_sidecar.server.weights.push_session import Push, PushFailed, PushSession, PushState
from rollout_sidecar.server.weights.worker_replies import Done
from rollout_sidecar.server.weights.worker_requests import Check, Load, Patch, Relabel

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import VllmEngine

log = logging.getLogger(__name__)


class Laps:
    """Seconds per step of one commit, for its response's timings: calling it
    with a name ends that step (the time since the last call)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, step: str) -> None:
        now = time.monotonic()
        self.spent[step] = self.spent.get(step, 0.0) + now - self._last
        self._last = now


class CommitPhases:
    """This server's phases of a push's commit (prepare, commit, abort);
    trainer/two_phase.py drives them across replicas."""

    def __init__(self, engine: Engine, settings: ServerSettings, metrics: ServerMetrics,
                 plane: DataPlane, session: PushSession) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.plane = plane
        self.session = session
        # The version every worker's staged copy holds (worker/patching.py):
        # the base a delta push may name; None when the next must be dense.
        self.delta_base: int | None = None
        self.staged_bytes: int | None = None  # every worker's staging, once a push ended
        self._laps = Laps()  # the commit under way's steps (CommitResponse.timings)

    @property
    def llm(self) -> VllmEngine:
        return self.engine.running()  # read late: the engine starts after we are built

    # ------------------------------------------------------------ phase 1

    async def prepare(self, req: PrepareRequest) -> PrepareResponse:
        t0 = time.monotonic()
        await self._require_macs(req.push_id, req.macs, "POST /weights/prepare")
        push = await self.session.prepare(
            req.push_id, lambda p: self._check(p, req.checksums, req.macs),
            self.settings.push_timeout_s)
        spent = time.monotonic() - t0
        return PrepareResponse(push_id=push.push_id, deadline_s=self.settings.push_timeout_s,
                               timings=_check_timings(spent, push.patch_s, within=True))

    async def _require_macs(self, push_id: str, macs: list[str] | None, call: str) -> None:
        """A push over a connection that promised bucket tags must carry them:
        400 naming the field, and the push ends (the old version serves), as
        any failed prepare does."""
        p = self.session.current
        if macs is None and p is not None and p.push_id == push_id and p.distributed \
                and self.plane.authenticated(p.req.connection_id):
            message = (f"macs: connection {p.req.connection_id} was made with a data-plane "
                       f"secret and bucket_macs, so {call} needs each bucket's tag (macs)")
            async with self.session.lock:
                if self.session.current is p:
                    await self.session.fail(p, message)
            raise BadRequest(message, "macs")

    async def _check(self, push: Push, checksums: list[int], macs: list[str] | None) -> None:
        """Every bucket arrived and matches its tag and CRC, and a delta's
        patches are in the staged copy; the model is untouched."""
        if push.req.unchanged:  # no bucket was sent: nothing to check
            if checksums or macs:
                raise PushFailed("checksums: a push of unchanged weights carries no bucket, "
                                 f"so no checksum or tag (got {len(checksums)})")
            return
        try:
            # The receive may still be running: it may take what is left of
            # the push's deadline, and no more.
            await ops.send(self.llm, Check(
                checksums=checksums, macs=macs,
                version=push.req.version if macs is not None else None,
                timeout_s=max(0.0, push.deadline - time.monotonic())))
        except Exception as e:
            raise PushFailed(f"push rejected, version {self.engine.gate.version} still "
                             f"serving: {e}") from e
        if push.req.delta_base is not None:
            await self._patch(push)

    async def _patch(self, push: Push) -> None:
        """A checked delta's patches into every worker's staged copy (the
        module docstring: before the commit window)."""
        t0 = time.monotonic()
        self.delta_base = None  # the staged copies change from here on
        try:
            await ops.send(self.llm, Patch())
        except Exception as e:
            raise PushFailed(f"push rejected while patching the staged copy, version "
                             f"{self.engine.gate.version} still serving: {e}") from e
        push.patch_s = time.monotonic() - t0

    # ------------------------------------------------------------ phase 2

    async def commit(self, req: CommitRequest) -> CommitResponse:
        p = self.session.current
        if p is not None and p.push_id == req.push_id and p.prepared is None:
            await self._require_macs(req.push_id, req.macs, "a commit without a prepare")
        return await self.session.commit(req.push_id,
                                         lambda p: self._commit(p, req.checksums, req.macs))

    async def _commit(self, push: Push, checksums: list[int] | None,
                      macs: list[str] | None = None) -> CommitResponse:
        t0 = time.monotonic()
        one_call = push.prepared is None
        if one_call:  # one call does both phases
            if checksums is None:
                raise PushFailed("commit of a push that was not prepared needs checksums")
            await self._check(push, checksums, macs)
        t_checked = time.monotonic()
        checked = _check_timings(t_checked - t0, push.patch_s, within=one_call)
        gate = self.engine.gate
        lap = self._laps = Laps()
        # An adapter over the loaded weights changes nothing a running request
        # uses (it keeps its own version's adapter): no drain, no pause.
        only, unchanged = push.req.adapter_only, push.req.unchanged
        async with gate.commit_window(push.policy, self.settings.commit_drain_s,
                                      drain=not only) as mode:
            # Unchanged weights: a running request's next token is sampled by
            # the same weights under either label, so `keep` needs no pause.
            pause = (not only and not unchanged) or mode == "abort"
            # `resume` is `keep` by its other name: clearing the cache below makes
            # the engine re-prefill every running request on the new weights.
            mode = "keep" if mode == "resume" else mode
            # An adapter-only commit changes no running request's version.
            mode = "wait" if only and mode == "keep" else mode
            lap("drain_s")
            try:
                if pause:
                    # clear_cache: vLLM drops the prefix cache, and with it the KV
                    # of running requests (preempted, then recomputed on the new
                    # weights at resume): no token ever attends to a cache that
                    # other weights built (engine/version_spans.py).
                    await self.llm.pause_generation(mode=mode, clear_cache=not unchanged)
                    lap("pause_s")
                await (self._relabel(push) if unchanged else self._load(push))
                # Before the publish: requests already finished keep the old tag.
                self.engine.freeze_finished()
                await gate.publish(push.req.version, mode)
                drafter = self._drafter_after(push)
                if mode == "keep":  # runs that would fall behind their bound start again
                    await self.engine.restart_lagging(push.req.version)
                lap("publish_s")
            finally:
                if pause:
                    await self.llm.resume_generation()
                    lap("resume_s")
        self.plane.touch()  # a push keeps the trainer's connection lease alive
        t1 = time.monotonic()
        self.metrics.pushes.labels("committed").inc()
        self.metrics.push_seconds.observe(t1 - push.started)
        self.metrics.commit_seconds.observe(t1 - t_checked)
        self.metrics.weight_version.set(push.req.version)
        self.metrics.suspect.set(0)  # a new version has not failed a probe yet
        log.info("committed weight_version=%d (%s; gate held %.3fs)", push.req.version, mode,
                 gate.last_hold_s)
        return CommitResponse(
            weight_version=push.req.version, push_id=push.push_id, commit_policy=mode,
            timings={"transfer_s": t0 - push.started, **checked,
                     "commit_s": t1 - t_checked, "gate_hold_s": gate.last_hold_s,
                     "total_s": t1 - push.started, **lap.spent},
            drafter=drafter)

    def _drafter_after(self, push: Push) -> DraftOutcome | None:
        """What the published push did to the drafter, if there is one."""
        d = self.engine.drafter
        if d is None:
            return None
        if push.req.unchanged:
            assert push.req.delta_base is not None
            return d.relabeled(push.req.delta_base, push.req.version)
        return d.committed(push.req.version,
                           carries_draft(push.req) and not push.req.adapter_only)

    async def _load(self, push: Push) -> None:
        gate, v, adapter = self.engine.gate, push.req.version, push.req.adapter
        table = self.engine.adapters
        only = push.req.adapter_only
        held, self.delta_base = self.delta_base, None  # the staged copies change from here on
        load = Load()
        if adapter is not None:  # a fresh LoRA id; the versions requests hold stay loaded
            new = table.new(v)
            load = Load(lora_id=new.lora_id, keep_ids=table.keep_ids(new, set(gate.leases)))
        try:  # a delta's patches are in the staged copies already (phase 1)
            await ops.send(self.llm, load)
            self._laps("load_s")
        except Exception as e:
            # Every worker refused before changing any parameter: only then may
            # the old version keep serving. One rank that loaded while another
            # refused leaves shards of two versions: broken, nothing published.
            untouched = isinstance(e, WorkerCallFailed) and e.untouched
            if only and untouched:
                self.delta_base = held  # refused before it changed anything
            if not untouched:  # past the point of no return
                gate.broken = (f"the load of weight_version {v} failed mid-commit ({e}); "
                               "the weights are in an unknown state, so /generate answers 503 "
                               "until a push succeeds")
                log.error(gate.broken)
            raise PushFailed(f"push rejected at load, version {gate.version} "
                             f"{'still serving' if gate.broken is None else 'unusable'}: {e}"
                             ) from e
        if adapter is None:
            self.delta_base = v
            table.published_full(v)
        else:  # an adapter-only load left the staged copy as it was
            self.delta_base = held if only else None
            table.published_adapter(new, load.keep_ids or [], with_base=not only)
        # Closes vLLM's session on every worker (it resets LoRA state there).
        self.held_staging(await ops.call(self.llm, WorkerOp.FINISH))
        self._laps("finish_s")
        await self.llm.update_weight_version(str(v))
        self._laps("label_s")

    async def _relabel(self, push: Push) -> None:
        """A delta with no change: every worker's staged copy, which the model
        serves, becomes `version` too (each checks it holds the base). No
        session, no load; the engine's label moves between two steps."""
        gate, v, base = self.engine.gate, push.req.version, push.req.delta_base
        assert base is not None, "an unchanged push names its base (begin checked it)"
        self.delta_base = None  # until every worker relabelled (begin checked the base)
        try:
            await ops.send(self.llm, Relabel(base=base, version=v))
        except Exception as e:
            # Nothing changed the model; the workers may disagree now: dense next.
            raise PushFailed(f"push of unchanged weights rejected, version {gate.version} "
                             f"still serving: {e}") from e
        self.delta_base = v
        self.engine.adapters.published_full(v)
        self._laps("relabel_s")
        await self.llm.update_weight_version(str(v))
        self._laps("label_s")

    def held_staging(self, replies: list[Done]) -> None:
        """What every worker's staging holds once a push ended."""
        self.staged_bytes = sum(r.staged_bytes for r in replies)
        self.metrics.staged_bytes.set(self.staged_bytes)

    # -------------------------------------------------------------- abort

    async def abort(self, push_id: str, reason: str) -> LastPush:
        async with self.session.lock:
            ended = self.session.ended.get(push_id)
            if isinstance(ended, LastPush):
                return ended  # aborting twice is fine
            push = self.session.require(push_id, PushState.RECEIVING, PushState.PREPARED)
            await self.session.fail(push, reason, outcome="aborted")
            assert self.session.last is not None  # fail() recorded it
            return self.session.last

    async def end_session(self) -> None:
        """Drop the staged push and close vLLM's session on every worker that
        has one; idempotent, so it needs no knowledge of which ranks failed.
        A failure here (a worker gone) leaves the next begin to close it."""
        try:
            self.held_staging(await ops.call(self.llm, WorkerOp.ABORT))
        except Exception as e:
            log.warning("ending the weight-update session: %s", e)

    async def on_failed(self, push: Push, reason: str, outcome: str) -> None:
        """The session's cleanup for every push that ends without a commit
        (abort, deadline, bad bucket, failed phase): every worker drops its
        staging and a distributed push's group is dropped."""
        await self.end_session()
        if push.distributed:  # the trainer's side of the group is out of step
            with contextlib.suppress(Exception):
                await self.plane.drop()
        self.metrics.pushes.labels(outcome).inc()
        log.warning("push of version %d %s: %s; version %d keeps serving", push.req.version,
                    outcome, reason, self.engine.gate.version)


def _check_timings(spent: float, patch_s: float | None, within: bool) -> dict[str, float]:
    """Phase 1's seconds: the check, and a delta's patches apart (`within`:
    `spent` includes them; a commit after a prepare reports them again)."""
    if patch_s is None:
        return {"check_s": spent}
    return {"check_s": spent - patch_s if within else spent, "patch_s": patch_s}
