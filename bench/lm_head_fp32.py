"""The fp32 LM head, measured: train/rollout logprob mismatch with bf16 heads on
both sides vs fp32 heads on both sides, same bf16 body, same tokens.

Run on the default model and on a copy whose lm_head is scaled by
--head-scale (default 10): the default model's random-init logits have std
~0.3 nats, where bf16 rounding of logits is negligible; trained LMs have logit
std of several nats, where it is not.

One run serves the default model twice in bf16 (vLLM `head_dtype` model, then
float32), samples sequences once, scores them on both servers (prompt
logprobs), and compares with a transformers forward of the same checkpoint with
a bf16 body and a bf16 or an fp32 head (the trainer side). Prints both gaps and
their ratio; a bf16-body fp32-head trainer against a bf16-head server is shown
too, to separate the two sides' contributions.

    .venv/bin/python bench/lm_head_fp32.py [--model DIR] [--samples 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import CACHE, default_model, load, machine, serve, table

PROMPTS = [list(b"Once upon a time"), list(b"hello "), list(b"The cat "), list(b"x")]


def trainer_logprobs(model: torch.nn.Module, seqs: list[list[int]], starts: list[int],
                     fp32_head: bool) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids, start in zip(seqs, starts, strict=True):
            x = torch.tensor([ids])
            hidden = model.model(input_ids=x).last_hidden_state  # bf16 body
            if fp32_head:
                logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
            else:
                logits = model.lm_head(hidden).float()
            lp = torch.log_softmax(logits[0], -1)
            out.append(lp[start - 1:-1].gather(-1, x[0, start:, None])[:, 0])
    return out


def served_logprobs(server, seqs: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    with server.client() as c:
        r = c.score(seqs)
    return [torch.tensor(res.prompt_logprobs[s:]) for res, s in zip(r.results, starts,
                                                                  strict=True)]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)])
    return d.mean().item()


def scaled_head(src: Path, scale: float) -> Path:
    """`src` with lm_head.weight x scale: logits of a trained model's magnitude."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = CACHE / f"{src.name}-head-x{scale:g}"
    if not (out / "model.safetensors").exists():
        shutil.copytree(src, out, dirs_exist_ok=True)
        tensors = load_file(src / "model.safetensors")
        tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def measure(model_path: Path, args: argparse.Namespace) -> list[list[object]]:
    logs = Path("bench-logs")
    seqs: list[list[int]] = []
    starts: list[int] = []
    served = {}
    for head in ("bfloat16", "float32"):
        env = {"ROLLOUT_SIDECAR_LM_HEAD_FP32": "1" if head == "float32" else "0"}
        with serve(model_path, logs / f"lm-head-{head}.log", env=env) as server:
            if not seqs:  # sample once; both servers score the same tokens
                with server.client() as c:
                    r = c.generate(prompt_token_ids=PROMPTS, sampling=dict(
                        n=args.samples, max_tokens=args.max_tokens, seed=0))
                for p, res in zip(PROMPTS, r.results, strict=True):
                    for s in res.samples:
                        seqs.append(p + s.token_ids)
                        starts.append(len(p))
            served[head] = served_logprobs(server, seqs, starts)
    from transformers import AutoModelForCausalLM

    body = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    trainer = {h: trainer_logprobs(body, seqs, starts, fp32_head=h == "float32")
               for h in ("bfloat16", "float32")}
    bf16, fp32 = gap(trainer["bfloat16"], served["bfloat16"]), gap(trainer["float32"],
                                                                    served["float32"])
    mixed = gap(trainer["float32"], served["bfloat16"])
    tokens = sum(len(t) for t in trainer["float32"])
    with torch.no_grad():
        x = torch.tensor([seqs[0]])
        spread = body(input_ids=x).logits.float().std().item()
    return [[model_path.name, f"{spread:.2f}", tokens, bf16, fp32, mixed, fp32 / bf16]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=16, help="per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--head-scale", type=float, default=10.0)
    args = ap.parse_args()
    base = args.model or default_model()
    print(machine())
    rows = measure(base, args) + measure(scaled_head(base, args.head_scale), args)
    print(load())
    print(table(["model", "logit std", "tokens", "bf16|bf16", "fp32|fp32", "fp32 trainer|bf16 "
                 "server", "fp32/bf16"], rows))
    print("columns: mean |dlogp| between trainer and server, heads trainer|server, bf16 body")


if __name__ == "__main__":
    main()
