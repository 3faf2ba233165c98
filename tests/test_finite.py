"""The sender's NaN/inf check reads bits, not floats: it must agree with
torch.isfinite on every bit pattern (all 65536 of each 16-bit type; specials
and random patterns of the wider ones), wherever the bad element sits."""

from __future__ import annotations

import pytest
import torch

from rollout_sidecar.trainer.pack import finite
from rollout_sidecar.trainer.pack.finite import all_finite

INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
          torch.float32: torch.int32, torch.float64: torch.int64}


def patterns(dtype: torch.dtype) -> torch.Tensor:
    it = INT_OF[dtype]
    if it is torch.int16:  # every pattern
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(it).view(dtype)
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 2,
                             float("inf"), float("-inf"), float("nan")], dtype=dtype)
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(torch.iinfo(it).min, torch.iinfo(it).max, (50_000,), dtype=it,
                         generator=g)
    return torch.cat([specials, bits.view(dtype), -specials[-1:]])  # -nan too


@pytest.mark.parametrize("dtype", list(INT_OF), ids=str)
def test_agrees_with_isfinite_on_every_pattern(dtype, monkeypatch):
    x = patterns(dtype)
    expected = torch.isfinite(x).tolist()
    got = [all_finite(x[i: i + 1]) for i in range(x.numel())]
    assert got == expected
    # and in blocks: a bad element found in a later block, not only the first
    monkeypatch.setattr(finite, "BLOCK", 1000)
    good = x[torch.isfinite(x)][:5000]
    assert all_finite(good)
    for pos in (0, 999, 1000, 4321, 4999):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = good.clone()
            y[pos] = bad
            assert not all_finite(y), (pos, bad)


def test_other_float_dtypes_fall_back_to_isfinite():
    x = torch.tensor([1.0, -2.0, 0.5]).to(torch.float8_e5m2)
    assert all_finite(x)
    assert not all_finite(torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2))
    assert all_finite(torch.empty(0, dtype=torch.bfloat16))
