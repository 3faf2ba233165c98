"""The KV cache's size (server/engine/kv_cache_size.py): the arithmetic, which
rule wins, and the sized default of a resolved vLLM config (a fake: no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine.kv_cache_size import (
    CPU_FULL_SEQS,
    CPU_HOST_SHARE,
    GIB,
    KV_ENV,
    bytes_per_token,
    choose,
    host_memory_bytes,
    size_for,
    sized_bytes,
)
from rollout_sidecar.server.model.default_model import MODEL_CONFIG


def test_bytes_per_token_of_the_default_model_and_a_7b_llama():
    heads = MODEL_CONFIG["num_key_value_heads"]
    head_dim = MODEL_CONFIG["hidden_size"] // MODEL_CONFIG["num_attention_heads"]
    assert bytes_per_token(MODEL_CONFIG["num_hidden_layers"], heads, head_dim, 2) == 3072
    # Llama-2-7B in bf16: 32 layers x 32 KV heads x 128: 512 KiB per token (docs/deploy.md)
    assert bytes_per_token(32, 32, 128, 2) == 512 * 1024
    # Llama-3-8B, GQA: 8 KV heads; at TP 2 each worker holds 4 of them
    assert bytes_per_token(32, 4, 128, 2) == bytes_per_token(32, 8, 128, 2) // 2
    # MLA (DeepSeek-V3): one latent of 512 + 64 per layer, no K/V pair
    assert bytes_per_token(61, 1, 576, 2, mla=True) == 61 * 576 * 2


def test_sized_bytes_holds_8_full_sequences_in_whole_blocks_plus_the_null_block():
    need, got = sized_bytes(3072, max_num_seqs=256, max_model_len=2048, block_size=128,
                            cap_bytes=100 * GIB)
    assert need == got == (CPU_FULL_SEQS * 16 + 1) * 128 * 3072  # 48 MiB and one block
    assert need < 64 * 2**20  # the default model: the tree stays under 2 GiB
    # fewer sequences than that: all of them, full length
    assert sized_bytes(10, 2, 129, 128, GIB)[0] == (2 * 2 + 1) * 128 * 10
    # a partial block still takes a whole one
    assert sized_bytes(10, 256, 129, 128, GIB, full_seqs=3)[0] == (3 * 2 + 1) * 128 * 10
    # capped, and the cap reported against what was needed
    need, got = sized_bytes(512 * 1024, 256, 4096, 128, 10 * GIB)
    assert (need, got) == ((CPU_FULL_SEQS * 32 + 1) * 128 * 512 * 1024, 10 * GIB)
    assert need > 16 * GIB


@pytest.mark.parametrize("gib, util, env, cpu, source, explicit, drop", [
    # the setting wins over everything, on both platforms, and drops the variable
    (0.5, 0.3, {KV_ENV: "4"}, True, "setting", GIB // 2, True),
    (2.0, None, {}, False, "setting", 2 * GIB, False),
    (1.0, None, {KV_ENV: "4"}, False, "setting", GIB, True),
    # a GPU: gpu_memory_utilization, whatever the CPU variable says
    (None, None, {KV_ENV: "4"}, False, "gpu", None, False),
    # CPU: the variable over an explicit utilisation; that over the sized default
    (None, 0.5, {KV_ENV: "4"}, True, "env", None, False),
    (None, 0.5, {}, True, "host_share", None, False),
    (None, None, {}, True, "sized", None, False),
    (None, None, {KV_ENV: ""}, True, "sized", None, False),  # empty is unset, as in vLLM
])
def test_precedence(gib, util, env, cpu, source, explicit, drop):
    c = choose(gib, util, env, on_cpu=cpu)
    assert (c.source, c.explicit_bytes, c.drop_env) == (source, explicit, drop)


def test_a_fractional_setting_rounds_up_to_a_byte():
    assert choose(0.1, None, {}, True).explicit_bytes == -(-GIB // 10)


def test_the_setting_is_a_flag_and_positive():
    from rollout_sidecar.server.cli_options import settings_parameters

    assert ServerSettings(kv_cache_gib=1.5).kv_cache_gib == 1.5
    assert ServerSettings().kv_cache_gib is None
    with pytest.raises(ValueError):
        ServerSettings(kv_cache_gib=0)
    flags = {p.name: p.default for p in settings_parameters()}
    assert "--kv-cache-gib" in flags["kv_cache_gib"].param_decls


def _vllm_config(dtype, max_model_len, tp=1, kv_heads=4, cache_dtype="auto", mla=False):
    """What size_for reads of a VllmConfig, for the default model's shape."""
    model = SimpleNamespace(
        dtype=dtype, max_model_len=max_model_len, use_mla=mla,
        get_num_layers=lambda pc: 3, get_head_size=lambda: 64,
        get_num_kv_heads=lambda pc: max(1, kv_heads // pc.tensor_parallel_size))
    return SimpleNamespace(model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=128))


def test_size_for_a_resolved_config():
    got, why = size_for(_vllm_config(torch.bfloat16, 2048), 256, host_bytes=24 * GIB)
    assert got == (CPU_FULL_SEQS * 16 + 1) * 128 * 3072 and "3072 B/token" in why
    assert "capped" not in why
    # fp32 doubles it; TP 2 halves each worker's share; an fp8 cache quarters fp32's
    assert size_for(_vllm_config(torch.float32, 2048), 256, 24 * GIB)[0] == 2 * got
    assert size_for(_vllm_config(torch.bfloat16, 2048, tp=2), 256, 24 * GIB)[0] == got // 2
    assert size_for(_vllm_config(torch.float32, 2048, cache_dtype="fp8"), 256,
                    24 * GIB)[0] == got // 2
    # the cap: never more than the legacy default's share of the host
    got, why = size_for(_vllm_config(torch.bfloat16, 2048), 256, host_bytes=GIB // 8)
    assert got == int(GIB // 8 * CPU_HOST_SHARE) and "capped" in why


def test_host_memory_is_at_most_the_machines():
    import os

    assert 0 < host_memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
