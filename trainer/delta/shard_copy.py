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

from rollout_sidecar.protocol.data_plane.delta_codec import bits
from rollout_sidecar.trainer.delta.early_sample import sample_changes
from rollout_sidecar.trainer.delta.shard_pieces import Piece

# Elements per step of a host diff (3 MiB of scratch in bf16); 256K-4M
# measured alike, 64K slower (per-chunk overhead).
CHUNK = 1 << 20


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
        self._chunk: torch.Tensor | None = None  # diff's scratch (host)
        self._mask = torch.empty(0, dtype=torch.bool)

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

    def advance(self, pieces: list[Piece], changes: list[LocalChange], version: int) -> None:
        """A delta every replica committed: write just what it carried into
        the copy (a piece that travelled whole is copied whole). Cheaper than
        `refresh`'s full cast, and exact to what was sent even if the model
        moved after the diff."""
        for t, p, c in zip(self._tensors, pieces, changes, strict=True):
            if c.where is not None:
                t[c.where - p.start] = c.values
            elif c.count:
                t.copy_(p.data)
        self.version = version

    def forget(self) -> None:
        """Drop the copy (e.g. `delta=False` again): the next push is dense."""
        self.version, self._tensors, self._layout = None, [], []

    def diff(self, i: int, piece: Piece, dense_above: float) -> LocalChange:
        """Piece `i` against the copy. Where more than `dense_above` of the
        piece changed, only the counts are kept (it may travel whole).

        On the host it runs in chunks of `CHUNK` elements through two reused
        scratch buffers, so the diff allocates nothing the size of a piece
        (whole-tensor ops would hold a wire-dtype copy and a mask of the
        largest piece: 3 bytes per element, the whole embedding on a DDP rank
        0). Time: half of whole-tensor ops on one 64M-element piece, the same
        on the 500m model's 93 tensors (bench/delta_codec.py, push_delta.py)."""
        base = self._tensors[i]
        if not (base.is_cpu and piece.data.is_cpu):
            return _diff_whole(piece, base, dense_above)
        n = base.numel()
        new, mask = self._scratch(base.dtype)
        where: list[torch.Tensor] | None = []
        values: list[torch.Tensor] = []
        count, first, last, max_gap = 0, -1, -1, 0
        # A piece already in the wire dtype is compared where it lies: no copy.
        cast = piece.data.dtype != base.dtype
        for at in range(0, n, CHUNK):
            k = min(CHUNK, n - at)
            src = new[:k].copy_(piece.data[at: at + k]) if cast else piece.data[at: at + k]
            local = changed_positions(src, base[at: at + k], mask)
            if not local.numel():
                continue
            if last >= 0:  # the gap from the previous chunk's last change
                max_gap = max(max_gap, at + int(local[0]) - last)
            if local.numel() > 1:
                max_gap = max(max_gap, int(torch.diff(local).max()))
            if first < 0:
                first = at + int(local[0])
            last = at + int(local[-1])
            count += local.numel()
            if where is not None and count > dense_above * n:
                where, values = None, []  # travels whole: only the counts matter
            if where is not None:
                where.append(local + (piece.start + at))
                values.append(src[local])  # a gather: a copy, whichever `src` is
        if count == 0:
            return LocalChange(None, None, 0, -1, -1, 0)
        first, last = piece.start + first, piece.start + last
        if where is None:
            return LocalChange(None, None, count, first, last, max_gap)
        return LocalChange(torch.cat(where), torch.cat(values), count, first, last, max_gap)

    def _scratch(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of the wire dtype and one of bools, kept for every diff."""
        if self._chunk is None or self._chunk.dtype != dtype:
            self._chunk = torch.empty(CHUNK, dtype=dtype)
            self._mask = torch.empty(CHUNK, dtype=torch.bool)
        return self._chunk, self._mask

    def sample(self, i: int, piece: Piece) -> tuple[int, int]:
        """(compared, changed) in a sample of piece `i` (early_sample.py)."""
        return sample_changes(piece, self._tensors[i])

    def values(self, i: int, piece: Piece) -> torch.Tensor:
        """Piece `i`'s current values in the copy's dtype and device (a piece
        that travels whole)."""
        base = self._tensors[i]
        return piece.data.to(device=base.device, dtype=base.dtype)


def changed_positions(new: torch.Tensor, base: torch.Tensor, mask: torch.Tensor
                      ) -> torch.Tensor:
    """Ascending flat positions where `new`'s bits differ from `base`'s (same
    dtype, 1-D; `mask`: bool scratch of at least their length).

    Compared 8 bytes at a time where both are 8-byte aligned (4 bf16 elements
    per word: the scan, most of a diff where little changed, runs about 1.7x
    faster), then element by element inside the changed words only. An
    unchanged run is found by `torch.equal` on the integer words first: no
    mask written or scanned, and it stops at the first change (measured on
    100M unchanged bf16 elements, one thread: 0.031 s -> 0.023 s; the no-op
    rows of bench/delta_codec.py)."""
    per = 8 // new.element_size()
    if per > 1 and new.numel() % per == 0 and new.data_ptr() % 8 == 0 \
            and base.data_ptr() % 8 == 0 and new.is_contiguous() and base.is_contiguous():
        if torch.equal(new.view(torch.int64), base.view(torch.int64)):
            return mask[:0].nonzero().reshape(-1)
        words = mask[: new.numel() // per]
        torch.ne(new.view(torch.int64), base.view(torch.int64), out=words)
        hit = words.nonzero().reshape(-1)
        at = (hit.unsqueeze(1) * per + torch.arange(per, device=hit.device)).reshape(-1)
        return at[bits(new)[at] != bits(base)[at]]
    if torch.equal(bits(new), bits(base)):
        return mask[:0].nonzero().reshape(-1)
    m = mask[: new.numel()]
    torch.ne(bits(new), bits(base), out=m)
    return m.nonzero().reshape(-1)


def _diff_whole(piece: Piece, base: torch.Tensor, dense_above: float) -> LocalChange:
    """A device copy (or a device piece): one pass over the whole piece (a
    chunked scan would sync with the device once per chunk)."""
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
