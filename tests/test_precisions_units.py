"""The precision table (protocol/precisions.py) against torch and
safetensors themselves: every fact a row states is the library's, so the
wire, the checkpoint index, the finite check and the probe, which all read
the table, agree with what they read and write."""

from __future__ import annotations

from typing import get_args

import pytest
import safetensors.torch
import torch

from rollout_sidecar.protocol.precisions import (
    FLOATING,
    PRECISIONS,
    SERVED,
    from_safetensors,
    precision,
    probe_tolerance,
)
from rollout_sidecar.server.engine_settings import ServeDtype


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_each_row_is_torch_and_safetensors_own(name: str):
    row, dtype = precision(name), getattr(torch, name)
    assert row.itemsize == dtype.itemsize
    assert row.floating == dtype.is_floating_point
    # safetensors' own code for the dtype (its header's spelling), both ways.
    assert safetensors.torch._TYPES[row.safetensors] is dtype
    assert from_safetensors(row.safetensors) == name
    if row.magnitude_mask is None:
        return
    # +inf's bits without the sign are the row's; the largest finite value's are below.
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]

    def bits(x: float) -> int:
        return int(torch.tensor([x], dtype=dtype).view(ints)[0]) & row.magnitude_mask

    assert bits(float("inf")) == bits(float("-inf")) == row.inf_bits
    assert bits(torch.finfo(dtype).max) < row.inf_bits <= bits(float("nan"))


def test_what_vllm_is_told_and_the_probe_read_the_rows():
    assert set(get_args(ServeDtype)) == {"auto", *SERVED} == {
        "auto", "float32", "bfloat16", "float16"}
    assert FLOATING == {n for n in PRECISIONS if getattr(torch, n).is_floating_point}
    # The coarser side decides; a precision with no tolerance is judged as bf16.
    assert probe_tolerance("float32", "float32") == 1e-3
    assert probe_tolerance("float32", "bfloat16") == probe_tolerance("bfloat16") == 0.1
    assert probe_tolerance("float16", "float32") == 0.05
    assert probe_tolerance("float64") == 0.1
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision("floaty")
    assert from_safetensors("F8_E8M0") == "F8_E8M0"  # no row: kept, refused by name later
