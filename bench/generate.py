"""Generation throughput: POST /generate vs offline vLLM vs transformers.

Same checkpoint, prompts and sampling (temperature 1, top-p 1, no top-k, one
seed per prompt) on all three paths; each gets a warm-up run, then `--repeats`
timed runs, and the median is reported. tokens/s = generated tokens / wall time
of the whole batch.

    /work/venv/bin/python bench/generate.py [--batch 32] [--max-tokens 128]

The server and the offline engine never run at the same time (memory, and so
they do not compete for the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import ENGINE_ENV, default_model, load, machine, median, serve, table

HTTP_TARGET_VS_VLLM = 0.9
HTTP_TARGET_VS_HF = 3.0
SEED = 0


@dataclass
class Result:
    name: str
    tokens: list[int]  # generated tokens, per timed repeat
    seconds: list[float]
    cpu: list[float] = field(default_factory=list)  # CPU seconds of the process tree

    @property
    def rates(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds, strict=True)]

    @property
    def tok_s(self) -> float:
        return median(self.rates)

    @property
    def tok_per_cpu_s(self) -> float:
        return median([t / c for t, c in zip(self.tokens, self.cpu, strict=True)])

    @property
    def best(self) -> float:
        # Less sensitive than the median to other work on a shared machine.
        return max(self.rates)


def tree_cpu_s() -> float:
    """User+system CPU seconds of this process and all its descendants (the server
    subprocess, or the offline engine's processes). Less sensitive than wall time
    to other work on a shared machine, though it counts vLLM's busy polling too."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class Timer:
    """Wall and process-tree CPU time of a block, appended to a Result."""

    def __init__(self, res: Result) -> None:
        self.res = res

    def __enter__(self) -> Timer:
        self.cpu0, self.t0 = tree_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.res.seconds.append(time.perf_counter() - self.t0)
        self.res.cpu.append(tree_cpu_s() - self.cpu0)


def make_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """Printable-byte prompts of 16..48 tokens (the default tokenizer: id == byte)."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(16, 49))] for _ in range(batch)]


def prompt_seed(i: int) -> int:
    # What the server derives from sampling.seed for prompt i (engine.py), so the
    # offline engine samples exactly the same tokens and does the same work.
    return (SEED + i * 1_000_003) % (2**63)


def bench_http(model: Path, prompts: list[list[int]], max_tokens: int, repeats: int,
               workdir: Path) -> Result:
    sampling = dict(n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
                    seed=SEED, logprobs=True)
    res = Result("HTTP /generate (GenerationClient)", [], [])
    with serve(model, workdir / "server.log") as server, server.client() as client:
        client.generate(prompt_token_ids=prompts, sampling=sampling)  # warm-up
        for _ in range(repeats):
            with Timer(res):
                r = client.generate(prompt_token_ids=prompts, sampling=sampling)
            res.tokens.append(r.usage.completion_tokens)
    return res


def bench_vllm(model: Path, prompts: list[list[int]], max_tokens: int, repeats: int) -> Result:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The server's engine arguments (server/engine/lifecycle.py), minus the push plumbing.
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=512, enforce_eager=True,
              gpu_memory_utilization=0.3, max_num_seqs=256, seed=0,
              logprobs_mode="raw_logprobs")
    params = [SamplingParams(n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
                             seed=prompt_seed(i), logprobs=0) for i in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    res = Result("offline vLLM LLM.generate", [], [])
    try:
        llm.generate(inputs, params, use_tqdm=False)  # warm-up
        for _ in range(repeats):
            with Timer(res):
                outs = llm.generate(inputs, params, use_tqdm=False)
            res.tokens.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()  # stop its engine process before the next path
        del llm
        gc.collect()
    return res


def bench_hf(model: Path, prompts: list[list[int]], max_tokens: int, repeats: int,
             dtype_name: str) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.server.model.default_model import PAD_ID

    dtype = getattr(torch, dtype_name)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    # One padded batch, left-padded so every row continues right after its prompt.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # min_new_tokens == max_new_tokens: EOS is masked, every row generates exactly
    # max_tokens, so the count below is exact. top_k=0: no top-k (HF defaults to 50).
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_tokens,
              min_new_tokens=max_tokens, pad_token_id=PAD_ID, attention_mask=mask)
    res = Result(f"transformers generate ({dtype_name})", [], [])
    torch.manual_seed(SEED)
    with torch.inference_mode():
        hf.generate(ids, **kw)  # warm-up
        for _ in range(repeats):
            with Timer(res):
                out = hf.generate(ids, **kw)
            res.tokens.append(int(out[:, width:].numel()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="prompts per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per path (median)")
    ap.add_argument("--model", type=Path, default=None,
                    help="local HF checkpoint (default: the embedded default model)")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="transformers dtype (fp32 is the faster baseline on this CPU)")
    args = ap.parse_args()

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    model = args.model or default_model()
    prompts = make_prompts(args.batch)
    print(f"machine: {machine()}")
    print(f"model: {model}  batch={args.batch}  max_tokens={args.max_tokens}  "
          f"repeats={args.repeats} (median)  prompts {min(map(len, prompts))}.."
          f"{max(map(len, prompts))} tokens")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        http = bench_http(model, prompts, args.max_tokens, args.repeats, Path(tmp))
    vllm = bench_vllm(model, prompts, args.max_tokens, args.repeats)
    hf = bench_hf(model, prompts, args.max_tokens, args.repeats, args.hf_dtype)

    rows = [[r.name, round(median(r.tokens)), median(r.seconds), r.tok_s, r.best,
             " ".join(f"{x:.0f}" for x in r.rates), median(r.cpu), r.tok_per_cpu_s]
            for r in (http, vllm, hf)]
    print()
    print(table(["path", "tokens", "median s", "tok/s (median)", "best tok/s",
                 "each run tok/s", "CPU s", "tok/CPU-s"], rows))
    print()
    for name, other, target in (("offline vLLM", vllm, HTTP_TARGET_VS_VLLM),
                                ("transformers", hf, HTTP_TARGET_VS_HF)):
        ratio = http.tok_s / other.tok_s
        print(f"HTTP / {name:<13}= {ratio:.2f} median, {http.best / other.best:.2f} best-of, "
              f"{http.tok_per_cpu_s / other.tok_per_cpu_s:.2f} per CPU-s "
              f"(target >= {target} on the median: {'met' if ratio >= target else 'MISSED'})")
    print(f"bench wall time: {time.perf_counter() - t_start:.0f}s; at the end {load()}")


if __name__ == "__main__":
    main()
