"""Lossless sparse patches of one tensor: what changed since a base, bit for bit.

The trainer encodes, a server worker decodes into its staged copy, so this
lives in the shared protocol layer (torch only, no HTTP). Values are compared
as bit patterns (an integer view of the same width), never as floats: -0.0
against 0.0 is a change, and a NaN that stays the same NaN is not.

Four forms; `encode` sends dense above `dense_above` of the elements changed,
else the smallest patch (bench/delta_codec.py prints the sizes and the
encode/apply speed of each, which set the default):
  dense:  every value (n * itemsize bytes)
  index:  int32 positions + values (k * (4 + itemsize))
  gaps:   uint16 distances between positions + values (k * (2 + itemsize)),
          possible while no two changes are 65536 or more apart
  bitmap: one bit per element + values (n / 8 + k * itemsize)
With 2-byte values, index beats dense below a density of 1/3, gaps below 1/2
and the bitmap below 15/16; the bitmap is the smallest from 1/16 up. Near the
top the saving is a few percent of the bytes for a scatter over the tensor,
so dense takes over at `dense_above`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
# Each byte value's 8 bits, least significant first: a bitmap unpacks with one
# row lookup per byte (3.6x faster than masking every byte with every weight).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8)


class PatchForm(str, Enum):
    DENSE = "dense"
    INDEX = "index"
    GAPS = "gaps"
    BITMAP = "bitmap"


@dataclass
class Patch:
    """One tensor's change: `positions` (per `form`) and the new `values`."""

    form: PatchForm
    numel: int
    positions: torch.Tensor  # int32 / uint16 (as int16 bits) / packed uint8; empty for dense
    values: torch.Tensor  # the changed values, in the tensor's dtype

    @property
    def nbytes(self) -> int:
        return (self.positions.numel() * self.positions.element_size()
                + self.values.numel() * self.values.element_size())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers of the same width (flat)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def changed(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Bool mask (flat) of elements whose bit pattern differs."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"patch base {tuple(base.shape)} {base.dtype} does not match "
                         f"{tuple(new.shape)} {new.dtype}")
    return bits(new) != bits(base)


def form_sizes(numel: int, nchanged: int, itemsize: int, max_gap: int) -> dict[PatchForm, int]:
    """Bytes each form takes (gaps only while every distance fits 16 bits)."""
    sizes = {PatchForm.DENSE: numel * itemsize,
             PatchForm.INDEX: nchanged * (4 + itemsize),
             PatchForm.BITMAP: (numel + 7) // 8 + nchanged * itemsize}
    if max_gap < 1 << 16:
        sizes[PatchForm.GAPS] = nchanged * (2 + itemsize)
    return sizes


# Measured (bench/delta_codec.py, 2 CPU cores, a 4096^2 bf16 tensor): encode +
# apply of the best patch costs as much as the dense bytes it saves on a 2 Gbit/s
# link at about 25% changed; faster links (or slower encoders) break even lower.
DENSE_ABOVE = 0.25


def encode(new: torch.Tensor, base: torch.Tensor, form: PatchForm | None = None,
           dense_above: float = DENSE_ABOVE) -> Patch:
    """The patch (the given form, else dense above `dense_above` of the
    elements changed, else the smallest) that turns `base` into `new`."""
    flat = new.reshape(-1)
    mask = changed(new, base)
    where = mask.nonzero().reshape(-1)
    gaps = torch.diff(where, prepend=where.new_zeros(1)) if where.numel() else where
    max_gap = int(gaps.max()) if gaps.numel() else 0
    if form is None and where.numel() > dense_above * flat.numel():
        form = PatchForm.DENSE
    if form is None:
        sizes = form_sizes(flat.numel(), where.numel(), flat.element_size(), max_gap)
        form = min(sizes, key=lambda f: sizes[f])
    empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
    if form is PatchForm.DENSE:
        return Patch(form, flat.numel(), empty, flat.clone())
    values = flat[where]
    if form is PatchForm.INDEX:
        return Patch(form, flat.numel(), where.to(torch.int32), values)
    if form is PatchForm.GAPS:
        if max_gap >= 1 << 16:
            raise ValueError("gaps form: two changes are 65536 or more elements apart")
        return Patch(form, flat.numel(), gaps.to(torch.int32).to(torch.int16), values)
    pad = (-flat.numel()) % 8
    padded = torch.cat([mask, mask.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    packed = (padded * _BIT_WEIGHTS.to(flat.device)).sum(1, dtype=torch.uint8)
    return Patch(form, flat.numel(), packed, values)


def positions(patch: Patch) -> torch.Tensor:
    """The changed positions (int64) a non-dense patch names."""
    p = patch.positions
    if patch.form is PatchForm.INDEX:
        return p.to(torch.int64)
    if patch.form is PatchForm.GAPS:
        return torch.cumsum(p.to(torch.int64) & 0xFFFF, 0)
    return _bitmap_mask(patch).nonzero().reshape(-1)


def _bitmap_mask(patch: Patch) -> torch.Tensor:
    """A bitmap patch's bool mask over the tensor's elements."""
    table = _BYTE_BITS.to(patch.positions.device)
    bits8 = table.index_select(0, patch.positions.reshape(-1).to(torch.int64))
    return bits8.view(torch.bool).reshape(-1)[:patch.numel]


def apply(patch: Patch, base: torch.Tensor) -> None:
    """Write the patch into `base` in place (its flat view)."""
    flat = base.view(-1)
    if patch.numel != flat.numel():
        raise ValueError(f"patch for {patch.numel} elements applied to {flat.numel()}")
    if patch.form is PatchForm.DENSE:
        flat.copy_(patch.values)
        return
    where = positions(patch)
    if where.numel() != patch.values.numel():
        raise ValueError(f"patch names {where.numel()} positions for "
                         f"{patch.values.numel()} values")
    flat[where] = patch.values.to(flat.dtype)


# ------------------------------------------------------------------ on the wire
# A patch slot in a bucket: its positions, padded to POSITION_ALIGN bytes, then
# its values (so they stay aligned for any dtype). The sizes follow from the
# form, the tensor's element count and the number of changes alone
# (manifest_api.patch_nbytes), so a manifest says them before any diff is sent.


def from_positions(form: PatchForm, numel: int, where: torch.Tensor, values: torch.Tensor
                   ) -> Patch:
    """The patch of `form` naming ascending flat positions `where` (int64)
    with their new `values`; a dense form takes every value, in order."""
    if form is PatchForm.DENSE:
        return Patch(form, numel, torch.empty(0, dtype=torch.uint8, device=values.device), values)
    if form is PatchForm.INDEX:
        return Patch(form, numel, where.to(torch.int32), values)
    if form is PatchForm.GAPS:
        gaps = torch.diff(where, prepend=where.new_zeros(1)) if where.numel() else where
        if gaps.numel() and int(gaps.max()) >= 1 << 16:
            raise ValueError("gaps form: two changes are 65536 or more elements apart")
        return Patch(form, numel, gaps.to(torch.int32).to(torch.int16), values)
    mask = torch.zeros(numel + (-numel) % 8, dtype=torch.uint8, device=where.device)
    mask[where] = 1
    packed = (mask.view(-1, 8) * _BIT_WEIGHTS.to(where.device)).sum(1, dtype=torch.uint8)
    return Patch(form, numel, packed, values)


def write(patch: Patch, out: torch.Tensor) -> None:
    """The patch's wire bytes into `out` (a uint8 view of exactly its slot)."""
    pos = patch.positions.reshape(-1).view(torch.uint8)
    split = out.numel() - patch.values.numel() * patch.values.element_size()
    if split < pos.numel():
        raise ValueError(f"patch of {pos.numel()} position bytes and "
                         f"{out.numel() - split} value bytes does not fit {out.numel()}")
    out[: pos.numel()].copy_(pos)
    out[pos.numel(): split].zero_()  # the padding: the CRC covers every byte
    out[split:].copy_(patch.values.reshape(-1).view(torch.uint8))


def read(raw: torch.Tensor, form: PatchForm, numel: int, changed: int, dtype: torch.dtype
         ) -> Patch:
    """The patch in a slot's bytes (views, no copy)."""
    vbytes = changed * dtype.itemsize
    split = raw.numel() - vbytes
    values = raw[split:].view(dtype)
    if form is PatchForm.DENSE:
        return Patch(form, numel, raw[:0], values)
    n = {PatchForm.INDEX: changed * 4, PatchForm.GAPS: changed * 2,
         PatchForm.BITMAP: (numel + 7) // 8}[form]
    pos = raw[:n]
    if form is PatchForm.INDEX:
        pos = pos.view(torch.int32)
    elif form is PatchForm.GAPS:
        pos = pos.view(torch.int16)
    return Patch(form, numel, pos, values)
