"""A bucket's pieces on a chain: even slices, or slot by slot so that each
lands in its tensor's place with no receive buffer.

A chain sends a bucket in pieces (bucket_group.py), `CHAIN_CHUNK_BYTES`
each (`even`). A receiver whose bucket holds a chunk of a split tensor
(every bucket of a push of own rows: trainer/gather/own_rows.py) does not
keep it as it came: each of its slots belongs in its tensor's place (server
placed_tensors.py). So it received such a bucket into a buffer lent for the
purpose and copied each slot out, and those buffers (the relay's window of
buckets) were what a push of own rows cost a server beyond a gathered
push's memory.

With `ConnectRequest.slot_pieces` (capability `pieces:slots`), such a bucket
travels as one piece per slot (a slot larger than `CHAIN_CHUNK_BYTES` in
several) and one per gap between slots (alignment), in byte order: every
receiver posts each slot's piece straight into its place, and a gap's into a
few bytes of its own. The bytes on the wire are the same, in the same order,
so the bucket's check value and tag run over the pieces as before. Both ends
cut the pieces from the manifest alone (`spans`), so they agree on every
piece's size, as gloo needs. Other buckets go in even pieces, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout_sidecar.protocol.schema import TensorSlot

CHAIN_CHUNK_BYTES = 16 << 20  # pipelines a 64+ MiB bucket; large enough to send at full speed
Span = tuple[int, int]  # [start, stop) bytes of a bucket


def even(buf: torch.Tensor) -> list[torch.Tensor]:
    """A bucket's pieces where not cut slot by slot: `CHAIN_CHUNK_BYTES` each."""
    return [buf[i: i + CHAIN_CHUNK_BYTES] for i in range(0, buf.numel(), CHAIN_CHUNK_BYTES)]


def holds_chunk(params: Sequence[TensorSlot]) -> bool:
    """A bucket that holds a chunk of a split tensor: it is not kept as it
    came (its slots land in their tensors' places)."""
    return any(p.chunk_offset is not None for p in params)


def spans(nbytes: int, params: Sequence[TensorSlot], most: int = CHAIN_CHUNK_BYTES
          ) -> list[Span]:
    """The bucket's pieces, slot by slot: each slot's bytes (in pieces of at
    most `most`) and each gap before, between and after them, in byte order.
    Raises ValueError where slots overlap or leave the bucket (the manifest's
    check refuses such a bucket before any piece is posted)."""
    out: list[Span] = []
    at = 0
    for p in sorted(params, key=lambda s: s.offset):
        if p.offset < at or p.offset + p.length > nbytes:
            raise ValueError(f"{p.name}: slot [{p.offset}, {p.offset + p.length}) overlaps "
                             f"another or leaves the bucket's {nbytes} bytes")
        if p.offset > at:
            out.append((at, p.offset))
        out += [(s, min(s + most, p.offset + p.length))
                for s in range(p.offset, p.offset + p.length, most)]
        at = p.offset + p.length
    if at < nbytes:
        out.append((at, nbytes))
    return out


def cut(buf: torch.Tensor, pieces: Sequence[Span]) -> list[torch.Tensor]:
    """Views of `buf` (a bucket's bytes), one per span."""
    return [buf[start:stop] for start, stop in pieces]
