"""Bucket bytes over torch.distributed: gloo on CPU, NCCL on GPU.

One group of its own: trainer rank 0 (the sender) plus every worker of every
replica, rendezvoused through the first replica's TCPStore, so it never
touches the trainer's FSDP process group. Each bucket leaves rank 0 once,
however many replicas listen: NCCL broadcasts it, gloo relays it down a chain
of the receivers (protocol/data_plane/bucket_group.py). Sends are asynchronous;
the pusher waits on a bucket's send only before reusing its buffer. The group's
per-operation timeout is the stall bound (control/deadlines.py): a piece that
does not move for that long fails the transfer on every rank, server and
trainer alike, whatever the push's overall budget. Forming it has a budget of
its own (`connect_timeout_s`).
`close()` releases the connection on every replica (POST /weights/disconnect), so
the next trainer connects at once: only a crashed trainer's lease runs out.
It then ends this side for good, before interpreter exit: the group is
destroyed in the calling thread (gloo's worker threads joined once their
queued sends are done), and a join abandoned after a failed connect is waited
for, since a thread still inside torch when finalization begins aborts the
process (protocol/data_plane/bucket_group.py, `close_group`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch

from rollout_sidecar.protocol.data_plane.bucket_group import (
    SENDER_RANK,
    broadcast_group,
    send_bucket,
)
from rollout_sidecar.protocol.data_plane.bucket_mac import PushMacs, new_secret
from rollout_sidecar.protocol.data_plane.bucket_pieces import Span
from rollout_sidecar.protocol.data_plane.ring_route import entry
from rollout_sidecar.protocol.data_plane.signed_store import (
    TAMPERED,
    abort_connection,
    delete_connection_keys,
)
from rollout_sidecar.protocol.schema import CHAIN_RING, PIECES_SLOTS, REQUIRES_BUCKET_MACS
from rollout_sidecar.protocol.transports import Fanout, transport
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.transport.peer_sender import Rendezvous

if TYPE_CHECKING:
    from rollout_sidecar.trainer.push_config import PushConfig

log = logging.getLogger(__name__)

# Each replica's POST /weights/disconnect at close: an answer takes
# milliseconds; a dead or wedged server costs at most this (per HTTP phase).
DISCONNECT_TIMEOUT_S = 5.0
# Connects tried when the rendezvous is tampered with, each under a fresh
# connection id and secret: a rogue that overwrites every key blocks them all,
# and then the push fails saying so instead of retrying forever.
CONNECT_TRIES = 3
# How long an abort marker stays before it is deleted: every rank polls for it
# every POLL_S (0.05 s), a busy replica's rank less often.
ABORT_SEEN_S = 1.0


def tampered_every_try(e: WeightPushError) -> WeightPushError:
    return WeightPushError(
        f"data plane: the rendezvous was tampered with on all {CONNECT_TRIES} tries, each "
        "under a fresh connection id and secret (someone else can reach the data-plane port; "
        f"restrict it, see docs/deploy.md); last: {e}")


class DistributedTransport:
    name = "gloo"
    # The CRCs go with the prepare (phase 1), so each is computed while its
    # bucket is on the wire.
    checksum_in_request = False

    def __init__(self, replicas: ReplicaAdmins, backend: str = "gloo",
                 data_plane_host: str | None = None, takeover: bool = False,
                 lease_wait_s: float = 60.0, fanout: str = "auto",
                 authenticate_buckets: bool = False) -> None:
        self.replicas = replicas
        self.backend = backend
        self.name = backend
        self.data_plane_host = data_plane_host
        self.takeover = takeover
        self.lease_wait_s = lease_wait_s
        self.trainer_id = uuid.uuid4().hex[:12]
        if fanout not in ("auto", "broadcast", "chain"):
            raise ValueError(f"fanout must be auto, broadcast or chain, not {fanout!r}")
        transport(backend).check_fanout(fanout)
        self.fanout_setting = fanout
        self.fanout: Fanout = "broadcast"  # this connection's; decided at connect
        self.senders = 1  # this connection's trainer ranks that send
        self.ring_starts: tuple[int, ...] | None = None  # this connection's (ring_route.py)
        self.slot_pieces = False  # this connection's (bucket_pieces.py)
        # Who this connection's group was formed with: each replica's URL and
        # its data-plane ranks, in rank order (`members`).
        self.members: tuple[tuple[str, int], ...] = ()
        self.group: Any = None
        self.connection_id: str | None = None
        self._secret: bytes | None = None  # this connection's; never logged
        self.authenticate_buckets = authenticate_buckets  # asked for by the user
        self._tagged = False  # this connection's buckets carry tags (asked or required)
        self.bucket_macs: PushMacs | None = None  # this push's tags (start_push)
        # Joins given up on (failed connects) and their outcomes: `close` waits for them.
        self._abandoned: list[tuple[threading.Thread, dict[str, Any]]] = []

    @classmethod
    def from_config(cls, name: str, replicas: ReplicaAdmins, config: PushConfig
                    ) -> DistributedTransport:
        return cls(replicas, name, config.data_plane_host, config.takeover,
                   config.lease_wait_s, config.fanout, config.authenticate_buckets)

    @property
    def buffer_device(self) -> torch.device:
        if transport(self.backend).on_device:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def ensure_connected(self, statuses: list[Any]) -> None:
        """Rank 0 alone (one sender): `plan_connect`, then `connect`, a
        rendezvous someone tampered with tried again under a fresh connection
        id and secret, `CONNECT_TRIES` times. With several senders the pusher
        runs the same steps on every rank (trainer/sender_connect.py)."""
        for attempt in range(1, CONNECT_TRIES + 1):
            rendezvous = self.plan_connect(statuses, 1)
            if rendezvous is None:
                return
            try:
                return self.connect(rendezvous)
            except WeightPushError as e:
                if TAMPERED not in str(e):
                    raise
                if attempt == CONNECT_TRIES:
                    raise tampered_every_try(e) from e
                log.warning("data-plane connect %d of %d: %s", attempt, CONNECT_TRIES, e)

    def members_of(self, statuses: list[Any]) -> tuple[tuple[str, int], ...]:
        """The replicas listed now with their data-plane ranks, in rank order."""
        return tuple((url, s.data_plane_ranks)
                     for url, s in zip(self.replicas.urls, statuses, strict=True))

    def connected(self, statuses: list[Any], senders: int) -> bool:
        """Our group, formed with `senders` senders and exactly the replicas
        listed now, is held by every one of them. The members count: after a
        replica leaves, the others still hold our group, whose ranks include
        the leaver's, and a broadcast on it would wait for them."""
        return self.group is not None and self.senders == senders \
            and self.members == self.members_of(statuses) \
            and all(s.connected == self.connection_id for s in statuses)

    def plan_connect(self, statuses: list[Any], senders: int) -> Rendezvous | None:
        """None where every replica holds our group with `senders` senders;
        else drop ours and draw a new connection: a fresh id and secret, the
        group's size and fan-out, the store (the first replica's). First push,
        a failed one (which drops the group on both sides), a replica that
        restarted, joined or left, another number of senders: every replica
        reconnects then, since a group's members are fixed when it forms."""
        if self.connected(statuses, senders):
            return None
        self.reset()
        self.members = self.members_of(statuses)
        offsets = [senders]  # each replica's first worker rank, after the senders
        for s in statuses:
            offsets.append(offsets[-1] + s.data_plane_ranks)
        world = offsets.pop()
        # gloo's broadcast is a binomial tree of whole buffers: with more than
        # one receiver rank 0 would send each bucket once per tree level, so
        # relay it down a chain (bench/push_replicas.py measures both). Several
        # senders always go point to point (peer_sender.py).
        fanout: Fanout = "chain" if senders > 1 else (
            transport(self.backend).fanout(world) if self.fanout_setting == "auto" else
            "chain" if self.fanout_setting == "chain" else "broadcast")
        # A ring (gloo, several replicas, fanout auto): each bucket enters at
        # a replica of its own, so no one replica's link relays all of it.
        ring = fanout == "chain" and self.fanout_setting == "auto" and len(statuses) > 1 \
            and not transport(self.backend).on_device \
            and all(CHAIN_RING in s.capabilities for s in statuses)
        # gloo's chain: buckets holding a chunk (own rows) go slot by slot, so
        # each lands in its place with no receive buffer (bucket_pieces.py).
        slot_pieces = fanout == "chain" and not transport(self.backend).on_device \
            and all(PIECES_SLOTS in s.capabilities for s in statuses)
        d = self.replicas.deadlines
        return Rendezvous(
            connection_id=uuid.uuid4().hex[:12], backend=self.backend,
            # The first replica hosts the rendezvous; the others meet there.
            store_host=self.data_plane_host or urlparse(self.replicas.urls[0]).hostname
            or "127.0.0.1", store_port=statuses[0].data_plane_port, world_size=world,
            senders=senders, rank_offsets=tuple(offsets), fanout=fanout, join_s=d.join_s,
            ring_starts=tuple(offsets) if ring else None, slot_pieces=slot_pieces,
            op_s=d.group_timeout_s,
            # Asked for, or required by a replica (`serve --require-bucket-macs`).
            authenticate_buckets=self.authenticate_buckets or any(
                REQUIRES_BUCKET_MACS in getattr(s, "requires", ()) for s in statuses),
            # Per connection, over the admin-authenticated control plane only:
            # signs the rendezvous and keys each bucket's tag (bucket_mac.py).
            secret=new_secret())

    def connect(self, rendezvous: Rendezvous) -> None:
        """Join `rendezvous` as rank 0 while every replica connects (their
        ranks follow the senders'); ranks 1 .. senders-1 join at the same time
        (peer_sender.py). Raises `WeightPushError`; a connection that will not
        form is ended on every rank still waiting for it (`_end_rendezvous`)."""
        r = rendezvous
        conn_id = self.connection_id = r.connection_id
        secret = self._secret = r.secret
        self._tagged = r.authenticate_buckets
        self.fanout, self.senders, self.ring_starts = r.fanout, r.senders, r.ring_starts
        self.slot_pieces = r.slot_pieces
        offsets = r.rank_offsets
        store_host, store_port = r.store_host, r.store_port
        out: dict[str, Any] = {}
        # Read here, in the caller's thread: the join thread's current CUDA
        # device is its own and starts at 0, whatever device rank 0 is on.
        device = self.buffer_device

        def join() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                out["group"] = broadcast_group(store_host, store_port, conn_id, SENDER_RANK,
                                               r.world_size, self.backend, r.join_s, secret,
                                               r.op_s, device=device)
            except BaseException as e:
                out["join_error"] = e

        # Each server's /weights/connect returns once the whole group formed,
        # so all of them and our own join run side by side; a refused connect
        # (another trainer owns a replica) fails at once.
        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        try:
            self.replicas.all(lambda admin, i: admin.connect(
                conn_id, self.backend, r.join_s, self.takeover, self.lease_wait_s,
                op_timeout_s=r.op_s, trainer_id=self.trainer_id, world_size=r.world_size,
                rank_offset=offsets[i], store=None if i == 0 else (store_host, store_port),
                fanout=r.fanout, secret=secret, bucket_macs=r.authenticate_buckets,
                senders=r.senders, ring_starts=r.ring_starts, slot_pieces=r.slot_pieces),
            "connect")
        except WeightPushError as e:
            self._end_rendezvous(joining, out, store_host, store_port, conn_id, secret, e)
            join_error = out.get("join_error")
            if join_error is not None and TAMPERED in str(join_error):
                raise WeightPushError(f"{e}; and this trainer's join: {join_error}") from e
            raise
        joining.join(r.join_s)
        if "group" not in out:
            why = out.get("join_error")
            self._end_rendezvous(joining, out, store_host, store_port, conn_id, secret,
                                 why or "join did not finish")
            raise WeightPushError(f"data plane {store_host}:{store_port}: "
                                  f"{why or 'join did not finish'}") from why
        self.group = out["group"]

    def _end_rendezvous(self, joining: threading.Thread, out: dict[str, Any], host: str,
                        port: int, conn_id: str, secret: bytes, why: object) -> None:
        """A connection that will never form: every rank still waiting on it
        (our join, a replica's) stops within a poll, on a signed abort marker
        (a first one, e.g. a tamper's, stays), rather than at its timeout.
        Left to time out, a refused connect's join held a thread for the whole
        `join_s`, which `close()`, or the finalizer of a pusher nobody
        closed, then waited for. Then the store's leftovers go (the marker, a
        rogue's keys). Best effort: a store we cannot reach keeps them, and a
        join that cannot see the marker ends by its own timeout (see close)."""
        where = f"{host}:{port}"
        try:
            store = torch.distributed.TCPStore(host, port, is_master=False,
                                               timeout=datetime.timedelta(seconds=5))
        except Exception as e:
            log.warning("data plane %s: could not end connection %s's rendezvous: %s", where,
                        conn_id, e)
            store = None
        if store is not None:
            abort_connection(store, conn_id, secret, where,
                             f"the trainer gave up this connection: {why}")
        joining.join(self.replicas.deadlines.stall_s)
        if store is not None:
            time.sleep(ABORT_SEEN_S)  # a replica's join polls for the marker too
            delete_connection_keys(store, conn_id)
        self._give_up(joining, out)  # a group it forms later: see close()
        if "group" in out:
            out.pop("group").close()

    @property
    def route(self) -> str:
        return "ring" if self.ring_starts else self.fanout

    def start_push(self, version: int) -> None:
        """A push of `version` begins: rank 0 tags its buckets with the
        connection's secret (the sender adds them, the prepare carries them)."""
        if self._tagged and self._secret is not None and self.connection_id:
            self.bucket_macs = PushMacs(self._secret, self.connection_id, version)
        else:
            self.bucket_macs = None

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: Sequence[Span] | None = None) -> Any:
        return send_bucket(self.group, buf, self.fanout,
                           first_receiver=entry(index, self.senders, self.ring_starts),
                           pieces=pieces)

    def reset(self) -> None:
        """Drop our side of the group now (see `close_group`)."""
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def _give_up(self, joining: threading.Thread, out: dict[str, Any]) -> None:
        if joining.is_alive():
            self._abandoned.append((joining, out))

    def _end_abandoned_joins(self) -> None:
        """Wait for each join given up on (it ends by its own timeout,
        `join_s`), then drop the group it may have formed since."""
        abandoned, self._abandoned = self._abandoned, []
        for thread, out in abandoned:
            thread.join(self.replicas.deadlines.join_s)
            if thread.is_alive():
                log.warning("data plane: a join given up on is still running after %.0f s",
                            self.replicas.deadlines.join_s)
            if "group" in out:
                out.pop("group").close()

    def close(self, timeout_s: float = DISCONNECT_TIMEOUT_S) -> None:
        """Release our connection on every replica at once (bounded, best
        effort: a replica that is down or refuses keeps it until its lease runs
        out, and the close goes on), then end our side of the group and any
        join still running. Idempotent."""
        conn, self.connection_id = self.connection_id, None
        if conn is not None:
            results = self.replicas.each(
                lambda admin, i: admin.disconnect(conn, self.trainer_id, timeout_s))
            for url, r in zip(self.replicas.urls, results, strict=False):
                if isinstance(r, Exception):
                    log.warning("disconnect of data-plane connection %s from %s: %s (a "
                                "connection the server still holds ends with its lease)",
                                conn, url, r)
        self.reset()
        self._end_abandoned_joins()
