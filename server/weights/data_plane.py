"""Who owns the weight data plane: the rendezvous store and one trainer's
connection at a time.

A trainer connects under a connection id; the vLLM worker joins that group in
a background thread, so generation goes on while the server waits for the
trainer, and a trainer that never joins costs a bounded wait, not a frozen
engine. The connection is the trainer's for `connection_lease_s` after its last
push call, or its own stall bound if shorter (a trainer silent longer than
that is stalled by its own measure): another trainer's connect within it is
refused with the owner named
(or takes over with `takeover=true`); once taken over, the old trainer's next
`begin` is refused, never left to hang on a dead group. The owner itself
(same `trainer_id`) may reconnect at any time: it rebuilds the group of all
replicas when one of them restarted. A trainer done pushing disconnects
(`WeightPusher.close()`), which ends its lease at once: only a crashed
trainer's lease has to run out.

With several replicas one group spans them all: the trainer names the
rendezvous store (one replica's), the group size and this server's first rank.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_sidecar.protocol.data_plane.ring_route import check_starts
from rollout_sidecar.protocol.schema import (
    REQUIRES_BUCKET_MACS,
    REQUIRES_SECRET,
    BucketManifest,
    ConnectRequest,
    ConnectResponse,
    DisconnectRequest,
    DisconnectResponse,
)
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.listeners import bind_port
from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.store_gate import StoreGate
from rollout_sidecar.server.weights.worker_replies import State

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import WorkerRpc

log = logging.getLogger(__name__)

POLL_S = 0.05  # the first wait between state polls, doubled up to POLL_MAX_S
# Each poll is an RPC after which vLLM's worker busy-waits for 1 s. With
# `engine_wait=spin` (and on GPU) that loop holds the GIL between sched_yields,
# so polled every 50 ms the worker never idles and our join thread in the same
# process waits for the GIL at every step of the rendezvous. A slow join is
# polled every 2 s, so the worker idles half the time (engine/idle_wait.py
# naps on CPU by default).
POLL_MAX_S = 2.0
REMEMBERED = 64  # ended connections remembered, for clear answers to late calls


@dataclass
class TrainerLease:
    """The trainer connection that holds this server's data plane: who, over
    which backend, and how long its lease lasts without a call."""

    id: str
    backend: str
    last_active: float
    trainer_id: str | None = None
    # The trainer sent a data-plane secret: its prepares must carry bucket tags.
    authenticated: bool = False
    # The trainer's own stall bound (its group's per-operation timeout): a
    # trainer silent for longer is stalled by its own measure, so its lease
    # ends then even when `connection_lease_s` is longer.
    stall_s: float | None = None
    senders: int = 1  # trainer ranks in the group (ConnectRequest.senders)

    def lease_s(self, setting: float) -> float:
        return setting if self.stall_s is None else min(setting, self.stall_s)


class DataPlane:
    def __init__(self, llm: WorkerRpc, settings: ServerSettings, ranks: int | None = None) -> None:
        self.llm = llm
        self.settings = settings
        # This server's ranks in the group: its workers, or one per host and
        # engine where they share a staged copy (the staging layout, set at start).
        self.ranks = ranks or llm.vllm_config.parallel_config.world_size_across_dp
        # Where this server's workers reach the store (rendezvous_address.py; set at start).
        self.worker_store_host = "127.0.0.1"
        self.gate = StoreGate()  # the rendezvous store, open while a trainer connects
        self.port = settings.data_plane_port
        self.owner: TrainerLease | None = None
        self.replaced: OrderedDict[str, str] = OrderedDict()  # old id -> who took over
        # Ended by a disconnect, a failed push or its own trainer's reconnect.
        self.released: OrderedDict[str, None] = OrderedDict()

    @property
    def bind_host(self) -> str:
        return self.settings.data_plane_host or self.settings.host

    async def start(self, listen_fd: int | None = None) -> None:
        """`listen_fd`: a socket bound to the port already (server/listeners.py),
        which the store's gate takes over (store_gate.py)."""
        # The server hosts the rendezvous store: trainers come and go, it stays.
        try:
            sock = socket.socket(fileno=listen_fd) if listen_fd is not None else bind_port(
                self.bind_host, self.settings.data_plane_port, "--data-plane-port")
            await self.gate.start(sock)
        except Exception as e:
            raise RuntimeError(f"data plane: cannot listen on {self.bind_host}:"
                               f"{self.settings.data_plane_port}: {e}") from e
        self.port = self.gate.port

    def stop(self) -> None:
        self.gate.stop()

    async def side(self, op: SideOp, payload: dict | None = None) -> dict:
        """Every worker's state, merged: connected once all are, failed or
        receiving if any is (naming the rank)."""
        try:
            replies = await ops.call(self.llm, op, **(payload or {}))
        except ops.WorkerCallFailed as e:
            return {"connection": {"state": "failed", "error": str(e)}, "receive": "failed",
                    "receive_error": str(e), "staged_bytes": 0}
        return merge_states(replies)

    def requires(self) -> list[str]:
        """What this server refuses a connect without (`WeightStatus.requires`)."""
        s = self.settings
        return [name for name, on in ((REQUIRES_SECRET, s.require_data_plane_secret),
                                      (REQUIRES_BUCKET_MACS, s.require_bucket_macs)) if on]

    def _check_requirements(self, req: ConnectRequest) -> None:
        """A connect without what this server requires: 400 naming the field."""
        required = self.requires()
        if req.secret is None and required:
            raise BadRequest("secret: this server takes no connect without a data-plane "
                             f"secret (it requires {', '.join(required)}); WeightPusher sends "
                             "one", "secret")
        if not req.bucket_macs and REQUIRES_BUCKET_MACS in required:
            raise BadRequest("bucket_macs: this server requires every bucket tagged with the "
                             "connection's secret (require_bucket_macs); WeightPusher tags "
                             "them for servers that say so in /weights/status", "bucket_macs")

    async def connect(self, req: ConnectRequest,
                      gone: Callable[[], Awaitable[bool]] | None = None) -> ConnectResponse:
        """Called with the push lock held, and no push in progress. The wait for
        the trainer's join ends early if `gone()` says its request went away
        (the trainer died or gave up): the lock is the next trainer's at once."""
        now = time.monotonic()
        old = self.owner
        workers = self.ranks
        try:
            transport(req.backend).check_fanout(req.fanout)
        except ValueError as e:
            raise BadRequest(str(e), "fanout") from None
        self._check_requirements(req)
        if req.senders > 1 and req.fanout != "chain":
            raise BadRequest(f"senders {req.senders}: several trainer ranks send point to point, "
                             "down a chain (fanout chain); a broadcast would carry every "
                             "bucket to every sender too", "senders")
        if req.ring_starts is not None:
            why = f"{req.backend} relays one chain (fused steps)" \
                if transport(req.backend).on_device else \
                "fanout broadcast has no chain" if req.fanout != "chain" else \
                check_starts(req.ring_starts, req.senders, req.world_size)
            if why is not None:
                raise BadRequest(f"ring_starts: {why}", "ring_starts")
        if req.slot_pieces and (req.fanout != "chain" or transport(req.backend).on_device):
            raise BadRequest(f"slot_pieces: {req.backend} with fanout {req.fanout} does not "
                             "relay pieces (gloo's chain does)", "slot_pieces")
        if req.rank_offset < req.senders:
            raise BadRequest(f"rank_offset {req.rank_offset}: ranks 0 .. {req.senders - 1} are "
                             "the trainer's senders", "rank_offset")
        if req.rank_offset + workers > req.world_size:
            raise BadRequest(f"rank_offset {req.rank_offset} + this server's {workers} "
                             f"data-plane ranks exceed world_size {req.world_size}",
                             "world_size")
        own = req.trainer_id is not None and old is not None and old.trainer_id == req.trainer_id
        if old is not None and old.id != req.connection_id and not (req.takeover or own):
            idle = now - old.last_active
            lease = old.lease_s(self.settings.connection_lease_s)
            if idle < lease:
                left = lease - idle
                raise PushConflict(
                    f"the data plane belongs to connection {old.id}, which pushed {idle:.0f}s "
                    "ago: another trainer is pushing to this server. If that trainer is gone, "
                    f"connect again after {left:.0f}s, or with takeover=true", left)
        timeout = min(req.timeout_s, self.settings.connect_timeout_max_s)
        # The store takes connections (ours, the trainer's, other replicas')
        # only while this connect runs (store_gate.py).
        with self.gate.window(req.connection_id):
            self.owner = None
            await self.side(SideOp.CONNECT, dict(
                store_host=req.store_host or self.worker_store_host,
                store_port=req.store_port or self.port,
                connection_id=req.connection_id, backend=req.backend, timeout_s=timeout,
                op_timeout_s=req.op_timeout_s,
                world_size=req.world_size, rank_offset=req.rank_offset, senders=req.senders,
                staging=self.settings.weight_staging, fanout=req.fanout,
                ring_starts=req.ring_starts, slot_pieces=req.slot_pieces,
                # Hex, to the workers only (StagedInitInfo keeps it out of its repr);
                # nothing logs this payload.
                secret=req.secret.get_secret_value() if req.secret is not None else None,
                bucket_macs=req.secret is not None and req.bucket_macs))
            log.info("data-plane connect %s: waiting up to %.0fs for the trainer to join",
                     req.connection_id, timeout)
            deadline, pause = now + timeout, POLL_S
            while True:  # short RPCs: the engine core schedules generation in between
                conn = (await self.side(SideOp.STATE))["connection"]
                if conn["state"] == "connected":
                    break
                left_us = gone is not None and await gone()
                if conn["state"] == "failed" or left_us or time.monotonic() > deadline:
                    await self.side(SideOp.DISCONNECT)
                    if old is not None and old.id != req.connection_id:
                        _remember(self.released, old.id, None)  # its group went at CONNECT
                    why = conn.get("error") or (
                        "the trainer went away before joining (its connect request closed)"
                        if left_us else f"the trainer did not join within {timeout:.0f}s")
                    log.warning("data-plane connect %s failed: %s", req.connection_id, why)
                    raise PushConflict(f"connect {req.connection_id}: {why} (is the data-plane "
                                       f"port {self.port} reachable from the trainer?)")
                await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
                pause = min(pause * 2, POLL_MAX_S)
        if old is not None and old.id != req.connection_id:
            if own:
                _remember(self.released, old.id, None)
            else:
                _remember(self.replaced, old.id, req.connection_id)
        self.owner = TrainerLease(req.connection_id, req.backend, time.monotonic(),
                                req.trainer_id,
                                authenticated=req.secret is not None and req.bucket_macs,
                                stall_s=req.op_timeout_s, senders=req.senders)
        return ConnectResponse(connection_id=req.connection_id, backend=req.backend)

    def check_owner(self, connection_id: str | None) -> None:
        """A distributed push must come over the connection that owns the plane."""
        if self.owner is not None and self.owner.id == connection_id:
            self.owner.last_active = time.monotonic()
            return
        if connection_id is not None and connection_id in self.replaced:
            raise PushConflict(f"connection {connection_id} was taken over by "
                               f"{self.replaced[connection_id]}: another trainer connected to "
                               "this server")
        raise PushConflict(f"connection {connection_id} is not connected (the server holds "
                           f"{self.owner.id if self.owner else 'none'}): POST /weights/connect")

    def check_senders(self, buckets: list[BucketManifest]) -> None:
        """Every bucket names a sender of the connection (after check_owner)."""
        senders = self.owner.senders if self.owner is not None else 1
        for b in buckets:
            if b.source >= senders:
                raise BadRequest(f"buckets[{b.index}].sender {b.source}: the connection has "
                                 f"{senders} sender{'s' if senders > 1 else ''} (ranks 0 .. "
                                 f"{senders - 1})", "buckets")

    def authenticated(self, connection_id: str | None) -> bool:
        """Whether the connection came with a secret (its buckets carry tags)."""
        return self.owner is not None and self.owner.id == connection_id \
            and self.owner.authenticated

    def touch(self) -> None:
        if self.owner is not None:
            self.owner.last_active = time.monotonic()

    async def disconnect(self, req: DisconnectRequest, busy: str | None) -> DisconnectResponse:
        """A trainer done pushing releases the data plane (push lock held).
        `busy`: the push in progress over this connection, if any (then 409).
        Idempotent: a connection already released gets 200 again."""
        cid, owner = req.connection_id, self.owner
        if owner is None or owner.id != cid:
            if cid in self.released:
                return DisconnectResponse(connection_id=cid, released=False,
                                          connected=owner.id if owner else None)
            if cid in self.replaced:
                raise PushConflict(f"connection {cid} was taken over by {self.replaced[cid]}: "
                                   "it holds nothing to release")
            raise PushConflict(f"connection {cid} is not connected (the server holds "
                               f"{owner.id if owner else 'none'})")
        if req.trainer_id is not None and owner.trainer_id is not None \
                and req.trainer_id != owner.trainer_id:
            raise PushConflict(f"connection {cid} belongs to trainer {owner.trainer_id}, not "
                               f"{req.trainer_id}")
        if busy is not None:
            raise PushConflict(f"{busy} over connection {cid}: commit or abort it before "
                               "disconnecting")
        await self.drop()
        return DisconnectResponse(connection_id=cid, released=True, connected=None)

    async def drop(self) -> None:
        """Release the plane: after a failed distributed push (both sides of
        the group are out of step), or at the owner's disconnect."""
        if self.owner is not None:
            _remember(self.released, self.owner.id, None)
        self.owner = None
        await self.side(SideOp.DISCONNECT)


def _remember(ended: OrderedDict, key: str, value: Any) -> None:
    ended.pop(key, None)
    ended[key] = value
    while len(ended) > REMEMBERED:
        ended.popitem(last=False)


# A connection is as far along as its least advanced worker.
_CONNECTION_ORDER = ("failed", "none", "connecting", "connected")


def merge_states(replies: list[State]) -> dict:
    """One state from every worker's (their `State` replies, rank order):
    the least advanced connection, a receive failed or running on any worker,
    errors named by rank when there are several."""
    def named(r: State, error: str | None) -> str | None:
        return error if len(replies) == 1 else f"worker rank {r.rank}: {error}"

    r = min(replies, key=lambda r: _CONNECTION_ORDER.index(r.connection["state"]))
    conn: dict = dict(r.connection)
    if "error" in conn:
        conn["error"] = named(r, conn["error"])
    failed = next((r for r in replies if r.receive == "failed"), None)
    running = any(r.receive == "running" for r in replies)
    return {"connection": conn,
            "receive": "failed" if failed else "running" if running else "idle",
            "receive_error": named(failed, failed.receive_error) if failed else None,
            "staged_bytes": sum(r.staged_bytes for r in replies)}
