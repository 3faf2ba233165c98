"""The weight routes' facade: connect, begin, buckets, and the phases that
live in their own modules.

State lives in two places: who owns the data plane (data_plane.py) and the
push in progress (push_session.py), both changed only under the session lock.
This module starts a push (connect, begin), releases a connection
(disconnect) and stages its HTTP buckets; the rest is one module per idea:

- self_report.py: what the server says of its weights (status, index),
- commit.py: prepare, commit, abort (the two-phase commit, server side),
- watchdog.py: the deadline and receive-failure watcher of every push,
- probe_scoring.py: POST /weights/probe and marking a version suspect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.data_plane.bucket_check import (
    DEFAULT_CHECK,
    bucket_check,
    crc32_of_bytes,
)
from rollout_sidecar.protocol.schema import (
    BeginRequest,
    BeginResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    DisconnectRequest,
    DisconnectResponse,
    LastPush,
    PrepareRequest,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
)
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine.engine_api import Engine, Scorer
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.weights import ops, rendezvous_address, staging_layout
from rollout_sidecar.server.weights.commit import CommitPhases
from rollout_sidecar.server.weights.data_plane import DataPlane
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.server.weights.peer_copy import PeerCopy
from rollout_sidecar.server.weights.probe_scoring import ProbeScorer
from rollout_sidecar.server.weights.push_session import Push, PushSession, PushState
from rollout_sidecar.server.weights.watchdog import PushWatchdog
from rollout_sidecar.server.weights.worker.host_share import StagingRoot
from rollout_sidecar.server.weights.worker_requests import Open, Stage

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.lifecycle import EngineInfo
    from rollout_sidecar.server.engine.vllm_surface import VllmEngine

log = logging.getLogger(__name__)


class WeightService:
    def __init__(self, engine: Engine, scorer: Scorer, settings: ServerSettings,
                 metrics: ServerMetrics, boot_id: str) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.boot_id = boot_id
        self.plane = DataPlane(engine.running(), settings)
        # Who stages where (staging_layout.py), and this host's shared staging
        # directory when its workers share one (worker/host_share.py): set at start.
        self.layout: staging_layout.StagingLayout | None = None
        self.shared_root: StagingRoot | None = None
        self.session = PushSession(self._on_failed)
        self.commits = CommitPhases(engine, settings, metrics, self.plane, self.session)
        self.watchdog = PushWatchdog(self.session, self.plane, settings)
        self.probes = ProbeScorer(engine.gate, scorer, metrics)
        self.peer_copy = PeerCopy(self)  # catching up from a peer, or a peer's copy read
        # The gate refuses a min_weight_version at once when no push could bring it.
        engine.gate.push_pending = self._push_pending

    def _push_pending(self) -> bool:
        return self.session.current is not None or self.peer_copy.running

    @property
    def llm(self) -> VllmEngine:
        return self.engine.running()

    @property
    def info(self) -> EngineInfo:
        """What the engine serves (set once it started, before we are built)."""
        info = self.engine.info
        if info is None:
            raise RuntimeError("the engine is not started")
        return info

    @property
    def last_probe(self) -> ProbeResult | None:
        return self.probes.last

    async def _on_failed(self, push: Push, reason: str, outcome: str) -> None:
        # Bound late: the session is built before the commit side that cleans up.
        await self.commits.on_failed(push, reason, outcome)

    async def start(self, listen_fd: int | None = None) -> None:
        """Decide the staging layout (raises `StagingDoesNotFit` where sharing
        was required and does not fit), then listen on the data plane."""
        s, info = self.settings, self.info
        staged = self.engine.index.push_bytes(info.dtype)
        hosts = await staging_layout.survey(self.llm)
        self.layout = layout = staging_layout.plan(hosts, s.share_host_staging,
                                                   s.weight_staging == "device", staged)
        self.plane.worker_store_host = rendezvous_address.store_host(self.plane.bind_host,
                                                                     hosts, s)
        for warning in layout.warnings:
            log.warning("staging: %s", warning)
        log.info("staging: %s (a staged copy: %.1f MiB)", layout.describe(), staged / 2**20)
        if layout.shared:
            self.shared_root = StagingRoot(self.boot_id)
            self.shared_root.create()
        await staging_layout.assign(self.llm, layout, self.boot_id)
        self.plane.ranks = layout.ranks
        await self.plane.start(listen_fd)

    async def stop(self) -> None:
        async with self.session.lock:
            p = self.session.current
            if p is not None and p.state is PushState.RECEIVING:
                await self.session.fail(p, "server shutting down", outcome="aborted")
        self.plane.stop()
        if self.shared_root is not None:
            self.shared_root.remove()

    # -------------------------------------------------------- connect, begin

    async def _supersede(self, trainer_id: str | None) -> None:
        """End a push its own trainer gave up on (lock held): a trainer that
        found this replica frozen at begin or prepare moved on, and the
        request it sent arrives once the replica thaws, opening a push nobody
        will finish. That trainer's next connect (it rebuilds its group after
        any failure) ends it at once, instead of being refused until
        `push_timeout_s` passes. A commit, or a check under way, finishes."""
        p, owner = self.session.current, self.plane.owner
        if p is None or p.state not in (PushState.RECEIVING, PushState.PREPARED):
            return
        if trainer_id is not None and owner is not None and owner.trainer_id == trainer_id \
                and p.req.connection_id == owner.id:
            await self.session.fail(p, "superseded: its trainer connected again",
                                    outcome="aborted")

    async def connect(self, req: ConnectRequest,
                      gone: Callable[[], Awaitable[bool]] | None = None) -> ConnectResponse:
        """`gone`: whether the trainer's connect request went away. A trainer
        that connects during a catch-up waits for it (its HTTP push holds the
        session), as its begin would."""
        await self._after_catch_up(f"connect {req.connection_id}")
        async with self.session.lock:
            await self._supersede(req.trainer_id)
            try:
                if (p := self.session.current) is not None:
                    owner = f" by connection {p.req.connection_id}" \
                        if p.req.connection_id else ""
                    raise PushConflict(f"push {p.push_id}{owner} is in progress: another "
                                       "trainer is pushing to this server; connect after it "
                                       "ends", 1.0)
                return await self.plane.connect(req, gone)
            except (PushConflict, BadRequest):
                # Its ranks may be at the store's gate already: let them see the
                # trainer's abort (store_gate.py: `refused`).
                self.plane.gate.refused(req.connection_id)
                raise

    async def disconnect(self, req: DisconnectRequest) -> DisconnectResponse:
        """A trainer done pushing releases the data plane at once."""
        async with self.session.lock:
            p = self.session.current
            busy = None
            if p is not None and p.distributed and p.req.connection_id == req.connection_id:
                busy = f"push {p.push_id} (version {p.req.version}) is {p.state.value}"
            return await self.plane.disconnect(req, busy)

    async def begin(self, req: BeginRequest) -> BeginResponse:
        """A trainer's begin: after this replica's catch-up from a peer, if
        one is running (peer_copy.py), so the push is ordered after it."""
        await self._after_catch_up(f"begin of version {req.version}")
        return await self.begin_now(req)

    async def _after_catch_up(self, what: str) -> None:
        """Wait for a running catch-up (bounded by its timeout); the status
        shows what waited (`catch_up.trainer_waited`)."""
        if not self.peer_copy.running:
            return
        self.peer_copy.timeline["trainer_waited"] = what
        try:
            await asyncio.wait_for(self.peer_copy.done.wait(), self.settings.catch_up_timeout_s)
        except TimeoutError:
            raise PushConflict("this replica is still catching up from a peer") from None

    async def begin_now(self, req: BeginRequest) -> BeginResponse:
        async with self.session.lock:
            if (p := self.session.current) is not None:
                raise PushConflict(f"push {p.push_id} (version {p.req.version}) is "
                                   f"{p.state.value}; one push at a time")
            if req.version <= self.engine.gate.version:
                raise PushConflict(f"version {req.version} is not newer than the served "
                                   f"version {self.engine.gate.version}")
            if transport(req.transport).joins_group:
                self.plane.check_owner(req.connection_id)
                self.plane.check_senders(req.buckets)
            elif bucket_check(req.check) is not DEFAULT_CHECK:  # a body's CRC-32, as it comes
                raise BadRequest(f"check {req.check}: the http transport's bodies are checked "
                                 "with crc32", "check")
            self._check_adapter(req)
            check_manifest(req, self.engine.index, self.info.dtype,
                           self.settings.max_lora_rank)
            held = self.commits.delta_base
            if req.delta_base is not None and req.delta_base != held:
                raise PushConflict(f"delta_base {req.delta_base}: this replica's staged copy "
                                   f"holds {'no complete version' if held is None else held}"
                                   "; send this push dense (see WeightStatus.delta_base)")
            push = self.session.new_push(req, req.commit_policy or self.settings.commit_policy,
                                         self.settings.push_timeout_s)
            if req.delta_base is None and not req.adapter_only:
                self.commits.delta_base = None  # a dense receive overwrites the staged copy
            try:  # opens vLLM's update session on every worker (worker_calls.py)
                if not req.unchanged:  # nothing will arrive: no session, no staging
                    await ops.send(self.llm, Open(
                        transport=req.transport, manifest=[b.model_dump() for b in req.buckets],
                        version=req.version, delta_base=req.delta_base,
                        adapter=req.adapter.model_dump() if req.adapter else None,
                        check=req.check))
            except Exception as e:
                await self.commits.end_session()  # on the ranks where it opened
                self.commits.delta_base = None  # the workers may disagree: start over dense
                if transport(req.transport).joins_group:
                    await self.plane.drop()
                raise PushConflict(f"could not start the receive: {e}") from e
            self.session.current = push
            self.watchdog.start(push)
            return BeginResponse(push_id=push.push_id, deadline_s=self.settings.push_timeout_s,
                                 commit_policy=push.policy)

    def _check_adapter(self, req: BeginRequest) -> None:
        """An adapter push needs LoRA on, and the base it names held here."""
        a, table = req.adapter, self.engine.adapters
        if a is None:
            return
        if not table.enabled:
            raise BadRequest("adapter: this server was started without --enable-lora; push "
                             "the merged model (WeightPusher adapter=False)", "adapter")
        if req.delta_base is not None:
            raise BadRequest("delta_base: an adapter push is never a delta", "delta_base")
        if a.base_version is not None and a.base_version != table.base_version:
            raise PushConflict(f"adapter.base_version {a.base_version}: this replica holds the "
                               f"full weights of version {table.base_version}; send the base "
                               "weights with the adapter (see WeightStatus.lora.base_version)")

    def bucket_size(self, push_id: str, index: int) -> int:
        """The bytes bucket `index` of HTTP push `push_id` carries (its
        manifest entry), before any of it is read."""
        push = self.session.require(push_id, PushState.RECEIVING)
        if push.distributed:
            raise PushConflict("this push uses the distributed data plane, not HTTP")
        if not 0 <= index < len(push.req.buckets):
            raise BadRequest(f"bucket {index}: push {push_id} has {len(push.req.buckets)} "
                             "buckets", "index")
        return push.req.buckets[index].nbytes

    async def stage_bucket(self, push_id: str, index: int, data: bytes | bytearray,
                           checksum: int) -> None:
        """Stage an HTTP bucket: its length against its manifest entry
        first, then its CRC, then into the workers."""
        async with self.session.lock:
            size = self.bucket_size(push_id, index)
            push = self.session.require(push_id, PushState.RECEIVING)
            if len(data) != size:
                await self.session.fail(push, f"bucket {index}: {len(data)} bytes over HTTP, "
                                        f"its manifest entry {size}")
                raise BadRequest(f"bucket {index}: {len(data)} bytes, the push's "
                                 f"buckets[{index}].nbytes is {size}; push {push_id} failed",
                                 f"buckets[{index}].nbytes")
            # Off the event loop: a 256 MiB bucket takes ~60 ms to checksum.
            if await asyncio.to_thread(crc32_of_bytes, data) != checksum:
                await self.session.fail(push, f"bucket {index} checksum mismatch over HTTP")
                raise PushConflict(f"bucket {index} checksum mismatch; push {push_id} failed")
            try:
                await ops.send(self.llm, Stage(bucket=index, data=data))
            except Exception as e:
                await self.session.fail(push, f"bucket {index} rejected: {e}")
                raise PushConflict(f"bucket {index} rejected: {e}") from e

    # ------------------------------------- the phases, in their own modules

    async def prepare(self, req: PrepareRequest) -> PrepareResponse:
        return await self.commits.prepare(req)

    async def commit(self, req: CommitRequest) -> CommitResponse:
        return await self.commits.commit(req)

    async def abort(self, push_id: str, reason: str) -> LastPush:
        return await self.commits.abort(push_id, reason)

    async def probe(self, req: ProbeRequest) -> ProbeResult:
        return await self.probes.probe(req)
