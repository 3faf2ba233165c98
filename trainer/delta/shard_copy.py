"""The copy of its own shard each trainer rank keeps: what every replica holds.

A delta is only right against the exact bits a replica has staged, so each
rank keeps its pieces (shard_pieces.py) in the wire dtype, as last pushed,
and diffs against them: 1/N of the model per rank, in host or device memory
(`PushConfig.delta_copy`). The copy moves to a new version only once every
replica committed it (`refresh`, after the commit): a failed, aborted or
partial push leaves it, and its `version`, where they were, which is the base
the servers still hold.

Changes are found by bit pattern (delta_codec.bits), never by value: -0.0
against 0.0 is a change, an unchanged NaN is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_sidecar.client.protocol.delta_codec import bits
from rollout_sidecar.trainer.delta.shard_pieces import Piece


@dataclass
class LocalChange:
    """What changed in one piece: `where` (int64, flat indices into the whole
    tensor, ascending) and the new `values` (wire dtype); None where the piece
    changed so much that it travels whole (recast when its bucket is sent)."""

    where: torch.Tensor | None
    values: torch.Tensor | None
    count: int
    first: int  # global index of the first change (-1: none)
    last: int  # global index of the last change (-1: none)
    max_gap: int  # largest distance between consecutive changes inside the piece


class ShardCopy:
    def __init__(self, location: str = "host") -> None:
        self.location = location
        self.version: int | None = None
        self._layout: list[tuple[str, int, int, torch.dtype]] = []
        self._tensors: list[torch.Tensor] = []

    def _key(self, pieces: list[Piece], dtypes: list[torch.dtype]
             ) -> list[tuple[str, int, int, torch.dtype]]:
        return [(p.name, p.start, p.data.numel(), d) for p, d in zip(pieces, dtypes, strict=True)]

    def holds(self, pieces: list[Piece], dtypes: list[torch.dtype]) -> bool:
        """A copy exists for exactly this layout (same tensors, shards, dtypes)."""
        return self.version is not None and self._layout == self._key(pieces, dtypes)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def _device(self, p: Piece) -> torch.device:
        return p.data.device if self.location == "device" else torch.device("cpu")

    def refresh(self, pieces: list[Piece], dtypes: list[torch.dtype], version: int) -> None:
        """Every replica committed `version`: the copy becomes the pieces now.
        Buffers are reused for the same layout, so the steady state allocates
        nothing."""
        key = self._key(pieces, dtypes)
        if key != self._layout:
            self.version, self._tensors, self._layout = None, [], []  # free before allocating
            self._tensors = [torch.empty(p.data.numel(), dtype=d, device=self._device(p))
                             for p, d in zip(pieces, dtypes, strict=True)]
        for t, p in zip(self._tensors, pieces, strict=True):
            t.copy_(p.data)  # casts to the wire dtype, and to the host, in place
        self._layout, self.version = key, version

    def forget(self) -> None:
        """Drop the copy (e.g. `delta=False` again): the next push is dense."""
        self.version, self._tensors, self._layout = None, [], []

    def diff(self, i: int, piece: Piece, dense_above: float) -> LocalChange:
        """Piece `i` against the copy. Where more than `dense_above` of the
        piece changed, only the counts are kept (it may travel whole)."""
        base = self._tensors[i]
        new = piece.data.to(device=base.device, dtype=base.dtype)
        mask = bits(new) != bits(base)
        local = mask.nonzero().reshape(-1)
        count = local.numel()
        if count == 0:
            return LocalChange(None, None, 0, -1, -1, 0)
        max_gap = int(torch.diff(local).max()) if count > 1 else 0
        first, last = piece.start + int(local[0]), piece.start + int(local[-1])
        if count > dense_above * new.numel():
            return LocalChange(None, None, count, first, last, max_gap)
        return LocalChange(local + piece.start, new[local], count, first, last, max_gap)

    def values(self, i: int, piece: Piece) -> torch.Tensor:
        """Piece `i`'s current values in the copy's dtype and device (a piece
        that travels whole)."""
        base = self._tensors[i]
        return piece.data.to(device=base.device, dtype=base.dtype)
