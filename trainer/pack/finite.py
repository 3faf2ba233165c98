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

from rollout_sidecar.protocol.precisions import PRECISIONS

BLOCK = 1 << 20  # elements per step: the scratch buffer is 2 to 8 MiB
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# dtype -> (same-size integer dtype, mask without the sign bit, bits of +inf):
# each precision's row that has them (protocol/precisions.py).
_BITS = {
    getattr(torch, p.name): (_INT_OF_SIZE[p.itemsize], p.magnitude_mask, p.inf_bits)
    for p in PRECISIONS.values() if p.magnitude_mask is not None and p.inf_bits is not None
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
