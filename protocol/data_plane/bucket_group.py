"""The data plane's process group: trainer rank 0 plus every worker of every
server replica, rendezvoused under a connection id through one server's
TCPStore. Both sides build it here, so both get the same name, ranks and
timeout. Each bucket leaves the trainer once, as a broadcast from rank 0.

Ranks: a server's workers sit at `rank_offset + dp_index * (TP * PP) + rank`
(vLLM's own NCCL engine numbers them the same way), and the trainer gives each
replica its offset, so N replicas of W workers make a group of 1 + N * W.

Two timeouts. Forming the group (`timeout_s`) is a one-off that may be slow
(a fresh container loads gloo cold); once formed, every wait on it gets
`op_timeout_s`, the trainer's stall bound, so a piece that does not move fails
the transfer on every rank instead of hanging.

A peer's failure must not take this process down: gloo raises in the waiting
thread; NCCL runs on a communicator of our own (nccl_group.py), not
`ProcessGroupNCCL`, whose watchdog and heartbeat monitor turn any failed work
into the process's death minutes later (nccl_library.py says how).

Fan-out. NCCL's broadcast is already a pipelined ring. gloo's is a binomial
tree of whole buffers: with two replicas rank 0 sends every bucket twice, one
after the other, so a push to N receivers took about log2(N + 1) times one
receiver's. `fanout="chain"` relays instead: rank 0 sends each bucket once, in
`CHAIN_CHUNK_BYTES` pieces (bucket_pieces.py), to rank 1, which forwards each piece to rank 2
while the next arrives, and so on; the last rank gets the bucket one piece
after the first. The trainer asks for it at connect, so a server keeps
following a trainer that predates it (plain broadcast).
"""

from __future__ import annotations

import contextlib
import datetime
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rollout_sidecar.protocol.data_plane import nccl_group
from rollout_sidecar.protocol.data_plane.bucket_pieces import Span, cut, even
from rollout_sidecar.protocol.data_plane.landing import Landing
from rollout_sidecar.protocol.data_plane.signed_store import (
    SignedStore,
    delete_connection_keys,
    group_prefix,
)
from rollout_sidecar.protocol.transports import Fanout, transport

SENDER_RANK = 0


class DataPlaneGroup:
    """A formed group; every wait on what it starts is bounded by `op_timeout_s`."""

    def __init__(self, pg: Any, op_timeout_s: float) -> None:
        self.pg = pg
        self.op_timeout = datetime.timedelta(seconds=op_timeout_s)

    def broadcast(self, buf: Any) -> _Works:
        return _Works([self.pg.broadcast(buf, SENDER_RANK)], self.op_timeout)

    def send(self, piece: Any, to_rank: int) -> _Works:
        return _Works([self.pg.send([piece], to_rank, 0)], self.op_timeout)

    def recv(self, piece: Any, from_rank: int) -> _Works:
        return _Works([self.pg.recv([piece], from_rank, 0)], self.op_timeout)

    def barrier(self) -> _Works:
        return _Works([self.pg.barrier()], self.op_timeout)

    def exchange(self, sends: Sequence[tuple[Any, int]], recvs: Sequence[tuple[Any, int]]
                 ) -> _Works:
        """Sends and receives, each `(piece, peer rank)`, all under way at once
        (NCCL's fused group, `NcclGroup.exchange`, in gloo's terms)."""
        works = [self.pg.send([b], peer, 0) for b, peer in sends]
        works += [self.pg.recv([b], peer, 0) for b, peer in recvs]
        return _Works(works, self.op_timeout)

    def abort(self) -> None:
        self.pg.abort()

    def close(self) -> None:
        """End the group now, in this thread (`close_group` says why). Idempotent."""
        pg, self.pg = self.pg, None
        if pg is not None:
            close_group(pg)


def broadcast_group(host: str, port: int, connection_id: str, rank: int, world_size: int,
                    backend: str, timeout_s: float, secret: bytes | None = None,
                    op_timeout_s: float | None = None,
                    device: torch.device | None = None
                    ) -> DataPlaneGroup | nccl_group.NcclGroup:
    """Blocks until every rank joined or `timeout_s` passes (then raises).
    With `secret` (the connection's), the rendezvous is signed and a tampered
    value raises `RendezvousTampered`; once the group formed, every rank
    deletes the keys it wrote (signed_store.py); a rank whose unsigned join
    fails deletes the connection's. `op_timeout_s`: each later
    operation's timeout (default `timeout_s`). `device`: NCCL's device for
    this rank (default: the calling thread's current one)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    store: Any = dist.PrefixStore(group_prefix(connection_id), tcp)
    signed = None
    if secret is not None:
        store = signed = SignedStore(store, secret, f"{host}:{port}", timeout_s)
    group: DataPlaneGroup | nccl_group.NcclGroup
    try:
        if transport(backend).on_device:  # NCCL, on a communicator of our own
            if device is None or device.type != "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            group = nccl_group.form(store, rank, world_size, device, timeout_s,
                                    op_timeout_s or timeout_s)
        else:
            group = DataPlaneGroup(dist.ProcessGroupGloo(store, rank, world_size, timeout),
                                   op_timeout_s or timeout_s)
    except BaseException:
        if signed is not None:
            signed.delete_written()  # the trainer clears the rest (abort marker, a rogue's)
        else:
            # Unsigned (a trainer from before secrets, a bare admin connect):
            # no rank knows what it wrote and no trainer clears up after a
            # failed try, so a server that outlives many failed connects
            # would keep one key per try. The group cannot form now.
            delete_connection_keys(tcp, connection_id)
        raise
    if signed is not None:
        try:
            group.barrier().wait()  # every rank is past the rendezvous
        except BaseException:
            group.close()
            raise
        finally:
            signed.delete_written()
    return group


def close_group(group: Any) -> None:
    """Abort the group's pending work and connections: NCCL aborts its
    communicators. gloo has no abort (ProcessGroupGloo keeps the base class's
    no-op, and its shutdown too): its threads end in its destructor, when the
    last reference goes, which waits for queued work (each bounded by the op
    timeout) and joins them, the GIL released. Left to interpreter exit, a
    worker that still has to release a tensor's PyObject waits for the GIL
    after finalization began, and CPython's pthread_exit inside its C++
    destructor aborts the process (SIGABRT, "terminate called without an
    active exception"); `DataPlaneGroup.close` drops that reference at once."""
    if group is None:
        return
    with contextlib.suppress(Exception):
        group.abort()


class _Works:
    def __init__(self, works: list[Any], timeout: datetime.timedelta) -> None:
        self.works = works
        self.timeout = timeout

    def wait(self) -> None:
        for w in self.works:
            w.wait(self.timeout)


def send_bucket(group: DataPlaneGroup, buf: Any, fanout: Fanout,
                first_receiver: int = SENDER_RANK + 1, pieces: Sequence[Span] | None = None
                ) -> _Works:
    """A sender: start sending one bucket (a flat uint8 tensor); returns what
    to wait on before the buffer is reused. In a chain it goes, in pieces, to
    the first receiver: the rank after the trainer's senders; `pieces`: cut
    slot by slot, else evenly (bucket_pieces.py)."""
    if fanout == "broadcast":
        return group.broadcast(buf)
    cuts = even(buf) if pieces is None else cut(buf, pieces)
    sends = [group.send(p, first_receiver) for p in cuts]
    return _Works([w for s in sends for w in s.works], group.op_timeout)


def receive_broadcast_bucket(group: DataPlaneGroup, buf: Any) -> None:
    """A receiver of a broadcast (one sender, rank 0): blocks until `buf` is here."""
    group.broadcast(buf).wait()


def relay_buckets(group: DataPlaneGroup, routes: Sequence[tuple[int, int | None]],
                  landing: Landing, window: int = 1) -> None:
    """A receiver in a chain: fill bucket k (`routes[k]`: its source rank,
    its next rank) where `landing` says, piece by piece, passing each piece
    on to its next rank (None: this rank is the bucket's last: ring_route.py)
    as it lands; blocks until every bucket is here and forwarded. Up to
    `window` buckets' pieces are posted at once: with several senders (each
    bucket from the one its manifest names) they all transmit side by side
    instead of taking turns. gloo matches a pair's messages in the order they
    were posted, so the next rank, which posts in the same order, gets each
    piece where it belongs. `landing` sees bucket k's pieces in order, while
    later ones arrive, and hears when its last piece went on (landing.py):
    at once, where this rank is the bucket's last, so a receiver that lends
    buffers holds `window` of them, not one more while the next is posted."""
    posted: deque[list[tuple[Any, _Works]]] = deque()
    forwarding: tuple[int, list[_Works]] | None = None  # the previous bucket's sends on
    following = 0  # the next bucket to post
    for k in range(len(routes)):
        while following < len(routes) and following < k + max(window, 1):
            pieces, (source, _) = landing.pieces(following), routes[following]
            posted.append([(p, group.recv(p, source)) for p in pieces])
            following += 1
        to = routes[k][1]
        sends = []
        for piece, arriving in posted.popleft():
            arriving.wait()
            if to is not None:
                sends.append(group.send(piece, to))
            landing.piece(k, piece)
        _passed_on(landing, forwarding)  # long done: the next rank took it meanwhile
        forwarding = (k, sends)
        if not sends:  # this rank is the bucket's last: its buffer is free before
            _passed_on(landing, forwarding)  # the next one is posted (window, not window + 1)
            forwarding = None
    _passed_on(landing, forwarding)


def _passed_on(landing: Landing, forwarding: tuple[int, list[_Works]] | None) -> None:
    if forwarding is not None:
        for w in forwarding[1]:
            w.wait()
        landing.passed_on(forwarding[0])
