"""Which elements of each served tensor this rank holds, without a gather.

A delta push diffs where the shard lives (shard_copy.py), so each rank needs
its part of every tensor as flat runs of elements: a `Piece` is one run, a
view of the rank's own storage and the flat index where it starts in the
whole tensor (C order). Three layouts:

- FSDP2 (`fully_shard`): a parameter sharded on dim 0, over a 1-D mesh or
  HSDP's 2-D one (replicated on its first dim); each rank's piece is the
  rows it sends as its own (trainer/gather/own_rows.py): its whole shard
  with FSDP2, a part of it with HSDP, where every replica group holds the
  same shards and each diffs a part;
- FSDP1: each unit's flat parameter holds a contiguous range of the unsharded
  flat parameter, and `_shard_param_infos` says which part of which original
  parameter it covers;
- plain modules and DDP: every rank holds everything, so rank 0 alone diffs.

Persistent buffers are never sharded: rank 0 holds them. A layout these do
not cover (shards on another dim, tensor parallelism) returns None, and the
push stays dense.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollout_sidecar.trainer.gather.full_tensors import (
    _fsdp1_units,
    _is_fsdp1,
    _unit_prefix,
    _unwrap,
    persistent_buffers,
)
from rollout_sidecar.trainer.gather.names import normalize_name
from rollout_sidecar.trainer.gather.own_rows import held_and_sent, row_groups


@dataclass
class Piece:
    """`data` (flat, the rank's own storage, any dtype) is elements
    `start .. start + data.numel()` of the whole tensor `name`."""

    name: str
    start: int
    data: torch.Tensor


def shard_pieces(model: nn.Module, rank: int, buffers: Sequence[str] = ()
                 ) -> list[Piece] | None:
    """This rank's pieces, in the same order on every rank (tensor by
    tensor, in `param_plan` order); None where a layout is not covered."""
    model = _unwrap(model)
    pieces: list[Piece] | None = _fsdp1(model, rank) if _is_fsdp1(model) else _by_param(model, rank)
    if pieces is None:
        return None
    if rank == 0:
        bufs = persistent_buffers(model)
        pieces += [Piece(n, 0, bufs[n].detach().reshape(-1)) for n in buffers]
    return pieces


def _by_param(model: nn.Module, rank: int) -> list[Piece] | None:
    out = []
    for name, p in model.named_parameters():
        p = p.detach()
        if not hasattr(p, "placements"):  # plain or DDP: every rank holds it whole
            if rank == 0:
                out.append(Piece(normalize_name(name), 0, p.reshape(-1)))
            continue
        piece = _rows_piece(normalize_name(name), p, rank)
        if piece is None:
            return None
        out.append(piece)
    return out


def _rows_piece(name: str, p: torch.Tensor, rank: int) -> Piece | None:
    """The rows of a dim-0 sharded DTensor this rank diffs: the rows it would
    send as its own (own_rows.py), so that with HSDP, where every replica
    group holds the same shards, each rank diffs model / N and no element is
    diffed twice. None: another placement, or a shard not laid out as those
    rows."""
    try:
        groups = row_groups(p)
    except ValueError:
        return None
    parts = held_and_sent(p.shape[0], groups)
    if rank not in parts:
        return None
    (held, held_end), (first, end) = parts[rank]
    local = p.to_local()
    if tuple(local.shape) != (held_end - held, *p.shape[1:]) or not local.is_contiguous():
        return None
    row = math.prod(p.shape[1:])
    return Piece(name, first * row, local.view(-1)[(first - held) * row: (end - held) * row])


def _fsdp1(model: nn.Module, rank: int) -> list[Piece] | None:
    out = []
    for unit in _fsdp1_units(model):
        handle = unit._handle
        flat = handle.flat_param
        infos = getattr(flat, "_shard_param_infos", None)
        if infos is None or len(infos) != len(flat._fqns):
            return None
        prefix = _unit_prefix(model, unit)
        local = flat.detach().reshape(-1)
        if not handle.uses_sharded_strategy:  # NO_SHARD: every rank holds it all
            if rank != 0:
                continue
        elif not handle.needs_unshard():
            # FSDP1 keeps a unit's gathered parameter after a forward that no
            # backward follows (the root's, after an eval forward; the probe
            # frees it: probe.reshard), and its next
            # forward reads that copy: the shard and what the model computes
            # with may differ until a backward frees it. Dense this once.
            return None
        for fqn, info in zip(flat._fqns, infos, strict=True):
            if not info.in_shard:
                continue
            out.append(Piece(normalize_name(prefix + fqn), info.intra_param_start_idx,
                             local[info.offset_in_shard: info.offset_in_shard
                                   + info.numel_in_shard]))
    return out
