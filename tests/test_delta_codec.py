"""Sparse patches (protocol/data_plane/delta_codec.py): every form restores the new
tensor bit for bit; bit patterns, not values, decide what changed. The oracle
is torch's own bitwise equality of the integer views."""

from __future__ import annotations

import pytest
import torch

from rollout_sidecar.protocol.data_plane.delta_codec import (
    PatchForm,
    apply,
    bits,
    changed,
    encode,
    form_sizes,
)

FORMS = list(PatchForm)


def step(base: torch.Tensor, density: float, seed: int = 0) -> torch.Tensor:
    """`base` after an update that changes about `density` of its elements."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    hit = torch.rand(base.shape, generator=g) < density
    new[hit] = (base[hit].float() + torch.randn(int(hit.sum()), generator=g)).to(base.dtype)
    return new


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(bits(a), bits(b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.6])
def test_every_form_restores_the_new_tensor(dtype, form, density):
    base = torch.randn(37, 301).to(dtype)  # numel not a multiple of 8
    new = step(base, density)
    patch = encode(new, base, form)
    out = base.clone()
    apply(patch, out)
    assert same_bits(out, new)
    assert patch.nbytes == form_sizes(new.numel(), int(changed(new, base).sum()),
                                      new.element_size(), 0)[form]


def test_signed_zero_and_nan_are_bit_patterns():
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as a value, a change as bits
    assert changed(new, base).tolist() == [True, False, False, False]  # NaN stays NaN
    out = base.clone()
    apply(encode(new, base, PatchForm.INDEX), out)
    assert torch.signbit(out[0]) and same_bits(out, new)


def test_auto_picks_the_smallest_form():
    base = torch.randn(64, 1024).to(torch.bfloat16)
    assert encode(base.clone(), base).nbytes == 0  # nothing changed
    assert encode(step(base, 0.01), base).form is PatchForm.GAPS
    assert encode(step(base, 0.15), base).form is PatchForm.BITMAP
    assert encode(step(base, 0.9), base).form is PatchForm.DENSE


def test_far_apart_changes_cannot_use_gaps():
    base = torch.zeros(200_000, dtype=torch.bfloat16)
    new = base.clone()
    new[[5, 100_000]] = 1.0  # 99 995 apart: more than 16 bits
    patch = encode(new, base)
    assert patch.form is PatchForm.INDEX
    with pytest.raises(ValueError, match="65536"):
        encode(new, base, PatchForm.GAPS)
    out = base.clone()
    apply(patch, out)
    assert same_bits(out, new)


def test_gaps_past_32767_survive_the_16_bit_view():
    base = torch.zeros(100_000, dtype=torch.float32)
    new = base.clone()
    new[[40_000, 90_000]] = 3.0  # gaps 40 000 and 50 000: negative as int16
    out = base.clone()
    apply(encode(new, base, PatchForm.GAPS), out)
    assert same_bits(out, new)


def test_a_patch_refuses_the_wrong_base():
    base = torch.randn(10)
    with pytest.raises(ValueError, match="does not match"):
        encode(torch.randn(11), base)
    patch = encode(step(base, 0.5), base, PatchForm.INDEX)
    with pytest.raises(ValueError, match="applied to"):
        apply(patch, torch.zeros(12))
