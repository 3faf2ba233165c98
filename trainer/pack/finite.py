"""Is every element of a packed bucket finite? Without float math.

A float is NaN or inf exactly when its exponent bits are all ones, that is when
its bits without the sign, read as an integer, are at least those of +inf. So
one AND and one max over an integer view of the same bytes decide it: on this
CPU about 20x faster than `torch.isfinite` on bf16 (which converts every
element to float first; it was two thirds of a push's send time). The work
goes in blocks into one reused scratch buffer, so the check adds a few MiB to
rank 0's peak, not a bucket.
"""

from __future__ import annotations

import torch

BLOCK = 1 << 20  # elements per step: the scratch buffer is 2 to 8 MiB

# dtype -> (same-size integer dtype, mask without the sign bit, bits of +inf)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def all_finite(t: torch.Tensor) -> bool:
    """True when `t` (contiguous) holds no NaN and no inf. Other float
    dtypes (float8 variants, whose NaN and inf encodings differ) use
    `torch.isfinite`, also in blocks."""
    flat = t.reshape(-1)
    spec = _BITS.get(flat.dtype)
    if spec is None:
        return all(bool(torch.isfinite(flat[i: i + BLOCK]).all())
                   for i in range(0, flat.numel(), BLOCK))
    int_dtype, magnitude, inf_bits = spec
    bits = flat.view(int_dtype)
    scratch = torch.empty(min(BLOCK, bits.numel()), dtype=int_dtype, device=bits.device)
    for i in range(0, bits.numel(), BLOCK):
        part = bits[i: i + BLOCK]
        out = scratch[: part.numel()]
        torch.bitwise_and(part, magnitude, out=out)
        if int(out.max()) >= inf_bits:
            return False
    return True
