"""A chain of several senders in fused steps: the relay NCCL runs.

gloo's relay (`bucket_group.relay_buckets`) posts each piece's receive and
its forward on their own, and gloo's threads move them side by side. An NCCL
call is a kernel on one stream, so posted one by one a receive from the
second sender would wait for the first sender's, and a forward for the next
receive: the senders would take turns and a relay would never send while it
receives. Here each step is one fused NCCL group (`NcclGroup.exchange`): the
previous step's pieces go on to the next rank while this step's arrive, one
piece from each sender at once.

The schedule (`chain_steps`) comes from the manifest alone, so every rank
computes the same one: each sender's pieces in its buckets' order, and step t
takes the t-th piece of every sender that has one. Between two ranks point to
point calls match in the order they are posted (NCCL and gloo alike): a
sender posts its pieces in that order, the first receiver receives them in
that order, and each relay forwards step t in its step t + 1, which is when
the next rank receives step t.

Staging in host memory receives through two sets of device slots, one piece
per sender each (2 x senders x `CHAIN_CHUNK_BYTES` of device memory while a
push arrives): step t lands in one set while step t - 1's leave from the
other, and each landed piece is copied to its host place before its slot is
reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_pieces import CHAIN_CHUNK_BYTES
from rollout_sidecar.protocol.data_plane.landing import Landing


@dataclass(frozen=True)
class Piece:
    bucket: int
    start: int
    stop: int
    source: int  # the trainer rank that sends it

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def chain_steps(buckets: Sequence[tuple[int, int]]) -> list[list[Piece]]:
    """`buckets`: each bucket's `(nbytes, sender)` in manifest order. Each
    step: at most one piece per sender, senders in the order they first
    appear; a bucket's pieces are `CHAIN_CHUNK_BYTES` slices, as the sender
    cuts them (`bucket_group.send_bucket`)."""
    queues: dict[int, list[Piece]] = {}
    for k, (nbytes, source) in enumerate(buckets):
        q = queues.setdefault(source, [])
        q.extend(Piece(k, i, min(i + CHAIN_CHUNK_BYTES, nbytes), source)
                 for i in range(0, nbytes, CHAIN_CHUNK_BYTES))
    longest = max((len(q) for q in queues.values()), default=0)
    return [[q[t] for q in queues.values() if t < len(q)] for t in range(longest)]


def relay_steps(group: Any, buckets: Sequence[tuple[int, int]], landing: Landing, rank: int,
                world_size: int, first_receiver: int, on_host: bool = False) -> None:
    """A receiver in a chain: fill each bucket (`(nbytes, sender)`, manifest
    order) where `landing` says, forwarding every piece to the next rank;
    blocks until all are here and passed on. The first receiver takes each
    piece from its sender, the others from the rank before. `on_host`
    buffers land through device slots on `group.device` (module docstring).
    `landing` sees bucket k's pieces in order, where they finally are, and
    hears when its last piece went on (landing.py)."""
    steps = chain_steps(buckets)
    forward = rank + 1 < world_size
    senders = max((len(s) for s in steps), default=0)
    device = getattr(group, "device", None)
    through_slots = on_host and device is not None
    slots = [[torch.empty(CHAIN_CHUNK_BYTES, dtype=torch.uint8, device=device)
              for _ in range(senders)] for _ in range(2)] if through_slots else None
    lent: dict[int, torch.Tensor] = {}

    def place(p: Piece) -> torch.Tensor:
        if p.start == 0:  # its first piece: where the bucket lands
            lent[p.bucket] = landing.buffer(p.bucket)
        return lent[p.bucket][p.start: p.stop]

    def gone(pieces: list[Piece]) -> None:  # forwarded: a bucket's last piece frees it
        for p in pieces:
            if p.stop == buckets[p.bucket][0]:
                del lent[p.bucket]
                landing.passed_on(p.bucket)

    leaving: list[torch.Tensor] = []  # the previous step's pieces, on the wire's side
    left: list[Piece] = []
    for t, step in enumerate(steps):
        dests = [place(p) for p in step]
        arriving = dests if slots is None else [slots[t % 2][i][: p.nbytes]
                                                for i, p in enumerate(step)]
        recvs = [(v, p.source if rank == first_receiver else rank - 1)
                 for v, p in zip(arriving, step, strict=True)]
        sends = [(v, rank + 1) for v in leaving] if forward else []
        group.exchange(sends, recvs).wait()
        gone(left)
        for v, dest, p in zip(arriving, dests, step, strict=True):
            if slots is not None:
                dest.copy_(v)  # to its host place, before the slot comes round again
            landing.piece(p.bucket, dest)
        leaving, left = arriving, step
        if not forward:
            gone(left)
            left = []
    if forward and leaving:
        group.exchange([(v, rank + 1) for v in leaving], []).wait()
    gone(left)
