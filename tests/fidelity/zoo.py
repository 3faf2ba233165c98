"""Tiny random checkpoints of the model families users bring, built on the spot.

No downloads: each family is a transformers config small enough to serve on
two CPU cores, saved as a plain HF checkpoint with the byte-level tokenizer of
the embedded default model. head_dim is 64 everywhere (vLLM's CPU attention
rejects smaller heads). Each entry names the trait it covers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout_sidecar.server.model.default_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    write_tokenizer,
)

_COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               pad_token_id=PAD_ID, hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=1024,
               initializer_range=0.05)


@dataclass(frozen=True)
class Family:
    name: str
    covers: str
    build: Callable[[], object]  # -> a transformers PreTrainedConfig
    # Older checkpoints carry rotary_emb.inv_freq, which neither vLLM nor
    # today's transformers model holds as state: the push must not need it.
    legacy_inv_freq: bool = False


def _cfg(module: str, cls: str, **kw: object) -> Callable[[], object]:
    def build() -> object:
        import importlib

        config_cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
        return config_cls(**{**_COMMON, **kw})
    return build


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama-tied-gqa", "Llama, tied lm_head, GQA (2 q heads : 1 kv head)",
           _cfg("llama", "LlamaConfig", num_key_value_heads=1, tie_word_embeddings=True)),
    Family("llama-untied-mha", "Llama, untied lm_head, MHA",
           _cfg("llama", "LlamaConfig", num_key_value_heads=2, tie_word_embeddings=False)),
    Family("qwen2-tied-bias", "Qwen2: q/k/v biases, tied lm_head, GQA",
           _cfg("qwen2", "Qwen2Config", num_key_value_heads=1, tie_word_embeddings=True)),
    Family("qwen3-qknorm", "Qwen3: q/k RMSNorm, tied lm_head, GQA",
           _cfg("qwen3", "Qwen3Config", num_key_value_heads=1, head_dim=64,
                tie_word_embeddings=True)),
    Family("mistral", "Mistral: GQA, untied lm_head; a legacy checkpoint with "
           "rotary_emb.inv_freq tensors",
           _cfg("mistral", "MistralConfig", num_key_value_heads=1, sliding_window=None,
                tie_word_embeddings=False), legacy_inv_freq=True),
    Family("phi3-fused", "Phi-3: fused qkv_proj and gate_up_proj in the HF checkpoint",
           _cfg("phi3", "Phi3Config", num_key_value_heads=1, tie_word_embeddings=False)),
    Family("gemma", "Gemma: tied lm_head, embedding scaled by sqrt(hidden), GeGLU",
           _cfg("gemma", "GemmaConfig", num_key_value_heads=1, head_dim=64)),
    Family("qwen3-moe", "Qwen3-MoE: 4 experts, top-2 routing",
           _cfg("qwen3_moe", "Qwen3MoeConfig", num_key_value_heads=1, head_dim=64,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                decoder_sparse_step=1, tie_word_embeddings=False)),
    Family("glm4-moe", "GLM-4.5 MoE: routed + shared experts, a dense first layer, and the "
           "router's e_score_correction_bias, a persistent buffer in the checkpoint",
           _cfg("glm4_moe", "Glm4MoeConfig", num_key_value_heads=1, head_dim=64, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                first_k_dense_replace=1, num_hidden_layers=2, tie_word_embeddings=False)),
]}


def write_family(name: str, out: Path, seed: int = 0) -> Path:
    """Write family `name` as an HF checkpoint (bf16 on disk, as on the hub)."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = FAMILIES[name].build()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    for m in model.modules():  # as released checkpoints do: the router bias stays fp32
        if getattr(m, "e_score_correction_bias", None) is not None:
            m.e_score_correction_bias.data = m.e_score_correction_bias.float()
    model.save_pretrained(out, safe_serialization=True)
    if FAMILIES[name].legacy_inv_freq:
        from safetensors.torch import load_file, save_file

        st = out / "model.safetensors"
        tensors = load_file(st)
        head_dim = config.hidden_size // config.num_attention_heads
        for i in range(config.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / (
                10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        save_file(tensors, st, metadata={"format": "pt"})
    write_tokenizer(out)
    (out / "family.json").write_text(json.dumps({"family": name}))
    return out
