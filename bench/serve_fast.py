"""Generation tokens/s: plain, quantized and speculative serving (issue 45).

Servers of one MoE checkpoint side by side: bf16; vLLM's online
`int8_per_channel_weight_only` (int8 experts; on x86 CPUs a W8A8 kernel that
needs AMX; skipped without it); and bf16 with `draft_model` drafters of
`--draft-layers` layers (the target's first layers, its embeddings and head:
a layer-skip drafter; all of them: a copy of the target, which agrees with
every greedy token, the ceiling any trained drafter approaches). Timed batches
alternate between them, so other work on the machine hits all alike; median
of `--repeats` after a warm-up each. The checkpoint is a random Qwen3-MoE of
the size given (byte tokenizer), built once into the bench cache; the
drafter's acceptance is read from /info over the timed batches. Greedy by
default (`--temperature`): vLLM's drafters propose their argmax, so at
temperature 1 a random model accepts few of them.

    .venv/bin/python bench/serve_fast.py [--batch 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

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


def build_drafter(target: Path, layers: int) -> Path:
    """The target's first `layers` layers with its embeddings, norm and head."""
    import json

    from safetensors.torch import load_file, save_file

    def write(tmp: Path) -> None:
        import shutil

        for f in target.iterdir():
            if f.suffix != ".safetensors" and f.is_file():
                shutil.copy(f, tmp / f.name)
        tensors = {}
        for f in target.glob("*.safetensors"):
            for name, t in load_file(f).items():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                    continue
                tensors[name] = t
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((target / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        (tmp / "done").write_text("")

    return cached(CACHE / f"{target.name}-first{layers}", write)


def has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--draft-layers", default="1,8", help="a drafter row per value: the "
                    "target's first N layers (N = --layers: a copy of the target)")
    ap.add_argument("--speculative-tokens", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    ckpt = build_moe(args.hidden, args.layers, args.experts, args.moe_intermediate)
    drafters = {int(n): build_drafter(ckpt, int(n)) for n in args.draft_layers.split(",")}
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randrange(16, 49))]
               for _ in range(args.batch)]
    sampling = dict(n=1, max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    k = args.speculative_tokens
    spec_rows = {f"bf16, drafter: the first {n} of {args.layers} layers, k={k}": json.dumps(
        {"method": "draft_model", "model": str(path), "num_speculative_tokens": k})
        for n, path in drafters.items()}
    variants = {"bf16": {}, f"bf16, {SCHEME}": {"ROLLOUT_SIDECAR_QUANTIZATION": SCHEME},
                **{row: {"ROLLOUT_SIDECAR_SPECULATIVE_CONFIG": spec}
                   for row, spec in spec_rows.items()}}
    if not has_amx():
        print(f"no AMX: {SCHEME} has no CPU kernel here, its row is left out")
        del variants[f"bf16, {SCHEME}"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        clients = {}
        for i, (v, env) in enumerate(variants.items()):
            server = stack.enter_context(serve(ckpt, Path(tmp) / f"server-{i}.log", env=env))
            clients[v] = stack.enter_context(server.client())
        for c in clients.values():
            c.generate(prompt_token_ids=prompts, sampling=sampling)  # warm-up
        before = {row: clients[row].info().drafter for row in spec_rows}
        for _ in range(args.repeats):
            for v, c in clients.items():
                t0 = time.perf_counter()
                r = c.generate(prompt_token_ids=prompts, sampling=sampling)
                rates[v].append(r.usage.completion_tokens / (time.perf_counter() - t0))
        acceptance = {row: _acceptance(before[row], clients[row].info().drafter)
                      for row in spec_rows}
    print(f"\nmachine: {machine()}; {ckpt.name}; batch {args.batch} x {args.max_tokens} "
          f"tokens at temperature {args.temperature}, median of {args.repeats}\n")
    base = median(rates["bf16"])
    print(table(["serving", "tokens/s", "vs bf16", "acceptance"],
                [[v, median(r), f"{median(r) / base:.2f}x",
                  f"{acceptance[v]:.2f}" if v in acceptance else "-"]
                 for v, r in rates.items()]))


def _acceptance(before: Any, after: Any) -> float:
    """Accepted / drafted tokens between two /info drafter blocks."""
    drafted = after.draft_tokens - before.draft_tokens
    return (after.accepted_tokens - before.accepted_tokens) / drafted if drafted else 0.0


if __name__ == "__main__":
    main()
