"""Generation tokens/s, plain against quantized serving (issue 45).

Two servers of one MoE checkpoint side by side: bf16, and vLLM's online
`int8_per_channel_weight_only` (int8 experts; on x86 CPUs a W8A8 kernel that
needs AMX). Timed batches alternate between them, so other work on the
machine hits both alike; median of `--repeats` after a warm-up each. The
checkpoint is a random Qwen3-MoE of the size given (byte tokenizer), built
once into the bench cache. Speculative serving is not built
(docs/fast-rollouts.md says why), so it has no row.

    .venv/bin/python bench/serve_quantized.py [--batch 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from pathlib import Path

import torch
from _common import CACHE, cached, machine, median, serve, table

SCHEME = "int8_per_channel_weight_only"


def build_moe(hidden: int, layers: int, experts: int, moe_intermediate: int) -> Path:
    """A random Qwen3-MoE checkpoint in bf16, cached by shape."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rollout_sidecar.server.model.default_model import (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        VOCAB_SIZE,
        write_tokenizer,
    )

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        head_dim=64, num_experts=experts, num_experts_per_tok=2,
        moe_intermediate_size=moe_intermediate, decoder_sparse_step=1,
        max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.05)

    def write(tmp: Path) -> None:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
            tmp, safe_serialization=True)
        write_tokenizer(tmp)
        (tmp / "done").write_text("")

    return cached(CACHE / f"qwen3moe-h{hidden}-l{layers}-e{experts}-i{moe_intermediate}",
                  write)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    args = ap.parse_args()
    ckpt = build_moe(args.hidden, args.layers, args.experts, args.moe_intermediate)
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randrange(16, 49))]
               for _ in range(args.batch)]
    sampling = dict(n=1, max_tokens=args.max_tokens, temperature=1.0, seed=0)
    variants = {"bf16": {}, f"bf16, {SCHEME}": {"ROLLOUT_SIDECAR_QUANTIZATION": SCHEME}}
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        clients = {}
        for i, (v, env) in enumerate(variants.items()):
            server = stack.enter_context(serve(ckpt, Path(tmp) / f"server-{i}.log", env=env))
            clients[v] = stack.enter_context(server.client())
        for c in clients.values():
            c.generate(prompt_token_ids=prompts, sampling=sampling)  # warm-up
        for _ in range(args.repeats):
            for v, c in clients.items():
                t0 = time.perf_counter()
                r = c.generate(prompt_token_ids=prompts, sampling=sampling)
                rates[v].append(r.usage.completion_tokens / (time.perf_counter() - t0))
    print(f"\nmachine: {machine()}; {ckpt.name}; batch {args.batch} x {args.max_tokens} "
          f"tokens, median of {args.repeats}\n")
    base = median(rates["bf16"])
    print(table(["serving", "tokens/s", "vs bf16"],
                [[v, median(r), f"{median(r) / base:.2f}x"] for v, r in rates.items()]))


if __name__ == "__main__":
    main()
