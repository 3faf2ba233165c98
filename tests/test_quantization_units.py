"""`serve --quantization`: the settings it is refused with, and the probe's
precision for a quantized server. The served proof is
tests/fidelity/test_quantized.py."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rollout_sidecar.protocol.precisions import precision
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.trainer.probe import QUANTIZED_TOLERANCE, default_tolerance

SCHEME = "int8_per_channel_weight_only"


def test_float32_serving_refuses_quantization_by_name():
    with pytest.raises(ValidationError, match="quantizes online from bfloat16") as e:
        ServerSettings(dtype="float32", quantization=SCHEME)
    assert e.value.errors()[0]["loc"] == ("quantization",)
    assert ServerSettings(dtype="bfloat16", quantization=SCHEME).quantization == SCHEME
    with pytest.raises(ValidationError, match="fp8_per_tensor"):  # vLLM's names only
        ServerSettings(quantization="int4")


def test_the_probe_holds_a_quantized_server_to_its_own_tolerance():
    bf16 = torch.bfloat16
    assert default_tolerance(bf16, bf16) == precision("bfloat16").probe_tolerance
    assert default_tolerance(bf16, torch.float32, SCHEME) == QUANTIZED_TOLERANCE
    assert QUANTIZED_TOLERANCE > precision("bfloat16").probe_tolerance


def test_an_empty_variable_is_no_quantization(monkeypatch):
    monkeypatch.setenv("ROLLOUT_SIDECAR_QUANTIZATION", "")  # compose's unset default
    assert ServerSettings().quantization is None
    monkeypatch.setenv("ROLLOUT_SIDECAR_QUANTIZATION", SCHEME)
    assert ServerSettings().quantization == SCHEME
