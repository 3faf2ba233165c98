"""Which elements of each served tensor this rank holds, without a gather.

A delta push diffs where the shard lives (shard_copy.py), so each rank needs
its part of every tensor as flat runs of elements: a `Piece` is one run, a
view of the rank's own storage and the flat index where it starts in the
whole tensor (C order). Three layouts:

- FSDP2 (`fully_shard`): a parameter sharded on dim 0 over a 1-D mesh; its
  local rows start at the global offset torch itself computes for the DTensor;
- FSDP1: each unit's flat parameter holds a contiguous range of the unsharded
  flat parameter, and `_shard_param_infos` says which part of which original
  parameter it covers;
- plain modules and DDP: every rank holds everything, so rank 0 alone diffs.

Persistent buffers are never sharded: rank 0 holds them. A layout these do
not cover (HSDP's 2-D mesh, shards on another dim) returns None, and the push
stays dense.
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
        start = _dim0_start(p)
        if start is None:
            return None
        local = p.to_local()
        if not local.is_contiguous():
            return None
        out.append(Piece(normalize_name(name), start, local.view(-1)))
    return out


def _dim0_start(p: torch.Tensor) -> int | None:
    """The flat index of this rank's first local element, for a parameter
    sharded on dim 0 over a 1-D mesh (FSDP2's default), else None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = p.placements
    if p.device_mesh.ndim != 1 or len(placements) != 1:
        return None
    if type(placements[0]) is not Shard or placements[0].dim != 0 or p.dim() == 0:
        return None
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    return offset[0] * math.prod(p.shape[1:])


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
