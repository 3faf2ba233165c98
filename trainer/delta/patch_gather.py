"""Changed elements to rank 0, bucket by bucket: no full tensor is gathered.

Two collectives per push before the begin (`DeltaDiff.stats`: each rank's
counts, all-gathered so every rank computes the same plan), then one gather
per bucket (`DeltaDiff.patches`): each rank sends rank 0 its changed
(position, value) pairs of that bucket's tensors, or its whole piece of a
tensor that travels dense; rank 0 joins the ranks' parts by where they start
(disjoint ranges, so positions stay sorted; with HSDP rank order is not
tensor order) and encodes each tensor's patch. Every rank walks the same
buckets, so the gathers line up; only rank 0's generator yields.

One payload per rank and bucket, int64-aligned:
    [m] [m x (tensor, start, count)] [positions of the patch entries] [values]
with each entry's values padded to 8 bytes.

The collectives are `settled` (trainer/collectives.py): no gloo thread is
left holding a payload when the push returns.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rollout_sidecar.protocol.data_plane.delta_codec import Patch, PatchForm, from_positions
from rollout_sidecar.protocol.schema import BucketManifest
from rollout_sidecar.trainer.collectives import device, gather_bytes, settled
from rollout_sidecar.trainer.delta.patch_plan import TensorPlan
from rollout_sidecar.trainer.delta.shard_copy import LocalChange, ShardCopy
from rollout_sidecar.trainer.delta.shard_pieces import Piece


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    return device() if _distributed() else torch.device("cpu")


def _every_rank(local: torch.Tensor) -> torch.Tensor:
    """Every rank's `local`, stacked in rank order, on every rank."""
    if not _distributed():
        return local.unsqueeze(0)
    dev = _comm_device()
    out = [torch.empty_like(local, device=dev) for _ in range(dist.get_world_size())]
    mine = local.to(dev)
    settled(lambda: dist.all_gather(out, mine, async_op=True), [*out, mine])
    return torch.stack([o.cpu() for o in out])


class DeltaDiff:
    """One push's diff on one rank: its pieces against its shard copy."""

    def __init__(self, pieces: list[Piece], copy: ShardCopy, names: list[str],
                 dense_above: float) -> None:
        self.pieces = pieces
        self.copy = copy
        self.names = names
        self.dense_above = dense_above
        self.tensor_of = {n: t for t, n in enumerate(names)}
        self.piece_of = {self.tensor_of[p.name]: i for i, p in enumerate(pieces)}
        self.changes: list[LocalChange] = []

    def sampled(self) -> torch.Tensor:
        """[ranks, tensors, 2] (compared, changed) in a sample of every
        piece (early_sample.py), on every rank: a collective."""
        local = torch.zeros(len(self.names), 2, dtype=torch.int64)
        for i, p in enumerate(self.pieces):
            local[self.tensor_of[p.name]] = torch.tensor(self.copy.sample(i, p))
        return _every_rank(local)

    def stats(self) -> torch.Tensor:
        """[ranks, tensors, 4] (count, first, last, max_gap), on every rank."""
        local = torch.zeros(len(self.names), 4, dtype=torch.int64)
        local[:, 1:3] = -1
        self.changes = [self.copy.diff(i, p, self.dense_above) for i, p in enumerate(self.pieces)]
        for p, c in zip(self.pieces, self.changes, strict=True):
            local[self.tensor_of[p.name]] = torch.tensor([c.count, c.first, c.last, c.max_gap])
        return _every_rank(local)

    def _entry(self, t: int, plan: TensorPlan) -> tuple[int, torch.Tensor | None, torch.Tensor]:
        """This rank's part of tensor `t`: (start, positions or None, values)."""
        i = self.piece_of[t]
        piece, change = self.pieces[i], self.changes[i]
        if plan.form is PatchForm.DENSE:
            return piece.start, None, self.copy.values(i, piece)
        if change.count and change.where is None:  # dense here, sparse overall
            change = self.copy.diff(i, piece, dense_above=1.0)
        if not change.count:
            return piece.start, torch.empty(0, dtype=torch.int64), \
                torch.empty(0, dtype=plan.dtype)
        return piece.start, change.where, change.values

    def _payload(self, tensors: list[int], plans: list[TensorPlan]) -> torch.Tensor:
        header, positions, values = [], [], []
        for t in tensors:
            if t not in self.piece_of:
                continue
            start, where, vals = self._entry(t, plans[t])
            header.append([t, start, vals.numel()])
            if where is not None:
                positions.append(where.cpu())
            raw = vals.reshape(-1).view(torch.uint8).cpu()
            values.append(torch.cat([raw, raw.new_zeros((-raw.numel()) % 8)]))
        head = torch.tensor([len(header)] + [x for h in header for x in h], dtype=torch.int64)
        pos = torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64)
        return torch.cat([head.view(torch.uint8), pos.view(torch.uint8), *values])

    def _gather(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's payload, on rank 0 (others get [])."""
        if not _distributed():
            return [payload]
        return gather_bytes(payload, dst=0)

    def patches(self, buckets: list[BucketManifest], plans: list[TensorPlan]
                ) -> Iterator[tuple[str, Patch | Exception]]:
        """(name, patch) for every slot of every bucket, on rank 0; on the
        other ranks nothing, after taking part in each bucket's gather."""
        for b in buckets:
            tensors = [self.tensor_of[s.name] for s in b.params]
            parts = self._gather(self._payload(tensors, plans))
            if not parts:
                continue
            by_tensor: dict[int, list[tuple[int, torch.Tensor | None, torch.Tensor]]] = {}
            for raw in parts:
                for t, entry in _parse(raw, plans):
                    by_tensor.setdefault(t, []).append(entry)
            for t in tensors:
                # A failure is yielded, not raised: rank 0 must still join
                # every later bucket's gather (the sender reports it).
                try:
                    patch: Patch | Exception = _join(
                        plans[t], sorted(by_tensor.get(t, []), key=lambda e: e[0]))
                except Exception as e:
                    patch = e
                yield plans[t].name, patch


def _parse(raw: torch.Tensor, plans: list[TensorPlan]
           ) -> Iterator[tuple[int, tuple[int, torch.Tensor | None, torch.Tensor]]]:
    ints = raw.view(torch.int64)  # every part is padded to 8 bytes
    m = int(ints[0])
    header = ints[1: 1 + 3 * m].view(m, 3).tolist()
    at = 8 * (1 + 3 * m)
    npos = sum(c for t, _, c in header if plans[t].form is not PatchForm.DENSE)
    pos = raw[at: at + 8 * npos].view(torch.int64)
    at += 8 * npos
    p = 0
    for t, start, count in header:
        plan = plans[t]
        nbytes = count * plan.dtype.itemsize
        vals = raw[at: at + nbytes].view(plan.dtype)
        at += nbytes + (-nbytes) % 8
        if plan.form is PatchForm.DENSE:
            yield t, (start, None, vals)
        else:
            yield t, (start, pos[p: p + count], vals)
            p += count


def _join(plan: TensorPlan, parts: list[tuple[int, torch.Tensor | None, torch.Tensor]]
          ) -> Patch:
    """The ranks' parts (disjoint ranges, by start: with HSDP rank order is
    not tensor order) as one patch."""
    values = torch.cat([v for _, _, v in parts]) if parts else torch.empty(0, dtype=plan.dtype)
    if values.numel() != plan.changed:
        raise RuntimeError(f"{plan.name}: the ranks sent {values.numel()} changed values, "
                           f"the plan counted {plan.changed} (did a rank's shard change "
                           "between the diff and the send?)")
    if plan.form is PatchForm.DENSE:
        starts = [s for s, _, v in parts]
        ends = [s + v.numel() for s, _, v in parts]
        if starts and (starts[0] != 0 or any(a != b for a, b in zip(ends, starts[1:],
                                                                     strict=False))):
            raise RuntimeError(f"{plan.name}: the ranks' pieces do not tile the tensor")
        return from_positions(PatchForm.DENSE, plan.numel, values.new_empty(0), values)
    where = torch.cat([w for _, w, _ in parts]) if parts else torch.empty(0, dtype=torch.int64)
    return from_positions(plan.form, plan.numel, where, values)
