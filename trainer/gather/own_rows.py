"""Each trainer rank's own rows: a dense push with no gather at all.

An FSDP2 parameter is, by default, a DTensor sharded on dim 0 over a 1-D mesh:
mesh rank i holds rows [i*c, min((i+1)*c, d0)), c = ceil(d0 / n) (torch.chunk,
which FSDP2 pads to equal shards: `_init_sharded_param` in torch's
`fsdp/_fully_shard/_fsdp_param.py`; the unpadded rows are `to_local()`). Rows
[a, b) of a C-order tensor are one byte range: a chunk, in the manifest's
terms (`TensorSlot.chunk_offset`, `nbytes`). So every rank sends its own rows
as they are, and nothing is gathered: each trainer link carries model / N
bytes. Every rank sending after full gathers instead uploads (N - 1) / N of
the model for the gathers on top (bench/push_links.py measures both).

HSDP (a 2-D mesh: replica groups, each sharding rows over its ranks): every
replica group holds the whole model, so each one sends a part of every
shard's rows (shard s's rows split over the groups as above), and again
every rank's link carries model / N, nothing gathered.

This goes where every rank sends a dense push of the model's own tensors
(no drafter), every parameter is a row shard over the whole trainer group
(FSDP2, HSDP) or held whole (no FSDP, DDP), and every replica takes a split
tensor's chunks in any order (`chunks:interleaved`). Otherwise
(`shard_placement_fn` on another dim, whose shards are strided column blocks,
not byte ranges of the tensor; tensor parallelism; FSDP1's flat parameters)
`why_not` names the first parameter that is not, and every rank gathers as
before.

The layout (`rank_pieces`, then pack/rank_buckets.py): each rank's rows, in
`param_plan` order, and the tensors every rank holds whole (persistent
buffers, unsharded parameters), each to the rank with the fewest bytes so far.

Each sharded tensor arrives as one chunk per rank; the server copies each
chunk to its place as its bucket lands (server placed_tensors.py), so a push
of own rows costs it no more memory than a gathered one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rollout_sidecar.protocol.schema import TensorSlot
from rollout_sidecar.trainer.gather.full_tensors import _is_fsdp1, _unwrap, persistent_buffers
from rollout_sidecar.trainer.gather.names import normalize_name
from rollout_sidecar.trainer.gather.row_blocks import FlatCursor


@dataclass(frozen=True)
class Piece:
    """Rows [first, end) of tensor `name`, in the list of the rank that
    sends them (`rank_pieces`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int
    end: int

    @property
    def covers_tensor(self) -> bool:
        return self.first == 0 and self.end == (self.shape[0] if self.shape else 1)


def row_groups(p: torch.Tensor) -> list[list[int]]:
    """The global ranks holding DTensor `p`'s row shards: one list per copy
    of the model (FSDP2: one; HSDP: one per replica group), each in shard
    order. ValueError unless it is sharded on dim 0, over a 1-D mesh or an
    HSDP mesh (replicated on its first dim, row-sharded on its second)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, p.placements
    kinds = [(type(q), getattr(q, "dim", None)) for q in placements]
    if p.dim() and mesh.ndim == 1 and kinds == [(Shard, 0)]:
        return [[int(r) for r in mesh.mesh.tolist()]]
    if p.dim() and mesh.ndim == 2 and kinds == [(Replicate, None), (Shard, 0)]:
        return [[int(r) for r in group] for group in mesh.mesh.tolist()]
    raise ValueError(f"placements {list(placements)} over a {mesh.ndim}-D mesh")


def _rows(d0: int, n: int) -> list[tuple[int, int]]:
    """Each mesh rank's rows of a dim-0 shard (torch.chunk's split)."""
    c = math.ceil(d0 / n) if d0 else 0
    return [(min(i * c, d0), min((i + 1) * c, d0)) for i in range(n)]


def held_and_sent(d0: int, groups: list[list[int]]) -> dict[int, tuple[tuple[int, int],
                                                                         tuple[int, int]]]:
    """Each rank's rows held and rows it sends: shard s of every replica
    group holds the same rows, and replica group g sends part g of them
    (`_rows` again), so every rank's link carries model / N with HSDP too."""
    out = {}
    for g, group in enumerate(groups):
        for rank, (first, end) in zip(group, _rows(d0, len(group)), strict=True):
            a, b = _rows(end - first, len(groups))[g]
            out[rank] = ((first, end), (first + a, first + b))
    return out


def why_not(model: nn.Module, world: int) -> str | None:
    """Why this rank's model cannot send its own rows (None: it can). Every
    rank must ask (the local shard's rows are checked) and agree."""
    model = _unwrap(model)
    if not dist.is_initialized():
        return "no process group"
    if _is_fsdp1(model):
        return "FSDP1: flat parameters, not rows (FSDP2 sends its own rows)"
    me = dist.get_rank()
    for name, p in model.named_parameters():
        if not hasattr(p, "placements"):
            continue  # held whole
        try:
            groups = row_groups(p)
        except ValueError as e:
            return f"{normalize_name(name)} is not a row shard: {e}"
        if sorted(r for g in groups for r in g) != list(range(world)):
            return f"{normalize_name(name)} is sharded over ranks {groups}, not the {world} " \
                "trainer ranks"
        (first, end), _ = held_and_sent(p.shape[0], groups)[me]
        if tuple(p.to_local().shape) != (end - first, *p.shape[1:]):
            return (f"{normalize_name(name)}: this rank holds {list(p.to_local().shape)}, "
                    f"not rows {first}..{end} of {list(p.shape)}")
    return None


def rank_pieces(model: nn.Module, world: int, buffers: Sequence[str] = ()
                ) -> list[list[Piece]]:
    """Every rank's pieces, in `param_plan` order (the same on every rank;
    no collective). `buffers` (persistent buffer names) come last."""
    model = _unwrap(model)
    out: list[list[Piece]] = [[] for _ in range(world)]
    load = [0] * world

    def whole(name: str, t: torch.Tensor) -> None:
        r = min(range(world), key=lambda r: (load[r], r))
        rows = t.shape[0] if t.dim() else 1
        out[r].append(Piece(name, tuple(t.shape), t.dtype, 0, rows))
        load[r] += t.numel() * t.element_size()

    for name, p in model.named_parameters():
        name = normalize_name(name)
        if not hasattr(p, "placements"):
            whole(name, p)
            continue
        row_bytes = math.prod(p.shape[1:]) * p.element_size()
        for r, (_, (first, end)) in sorted(held_and_sent(p.shape[0], row_groups(p)).items()):
            if end > first:
                out[r].append(Piece(name, tuple(p.shape), p.dtype, first, end))
                load[r] += (end - first) * row_bytes
    bufs = persistent_buffers(model) if buffers else {}
    for name in buffers:
        whole(name, bufs[name])
    return out


class OwnRows:
    """This rank's source for its pieces: each tensor's local rows (or the
    whole tensor), found by name as the sender packs them."""

    def __init__(self, model: nn.Module, buffers: Sequence[str] = ()) -> None:
        model = _unwrap(model)
        self._params = {normalize_name(n): p.detach() for n, p in model.named_parameters()}
        self._params.update(persistent_buffers(model) if buffers else {})
        self._cursors: dict[str, FlatCursor] = {}

    def source(self, slot: TensorSlot) -> torch.Tensor | FlatCursor:
        """An unsplit slot's tensor (this rank holds it whole), or a cursor
        over this rank's rows that takes the whole tensor's element offsets
        (`FlatCursor.copy_to`), one per tensor for all its chunks."""
        p = self._params[slot.name]
        sharded = hasattr(p, "placements")
        local = p.to_local() if sharded else p
        if slot.chunk_offset is None:
            return local
        cursor = self._cursors.get(slot.name)
        if cursor is None:
            first = 0
            if sharded:  # the rows this rank holds start there
                first = held_and_sent(p.shape[0], row_groups(p))[dist.get_rank()][0][0]
            cursor = FlatCursor(local, start=first * math.prod(p.shape[1:]), numel=p.numel())
            self._cursors[slot.name] = cursor
        return cursor
