"""`engine_wait` nap vs spin on CPU: generation throughput, and what is left
of the engine's core for a neighbour (a trainer, another replica) pinned to it.

For each mode, one server of the default model. First the generation batch
alone, then again with a neighbour: a process pinned to the vLLM worker's
core that counts arithmetic loops until the batch ends. The neighbour's
loops per second are compared with what it gets on that core with no server.

    /work/venv/bin/python bench/engine_wait.py [--batch 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import default_model, machine, median, serve, table

NEIGHBOUR = ("import sys, time\nn, end = 0, time.monotonic() + float(sys.argv[1])\n"
             "while time.monotonic() < end:\n    sum(range(1000)); n += 1\nprint(n)")


def worker_cpu(server_pid: int) -> int:
    """The core vLLM bound the worker of this server to (its first, if several)."""
    for p in psutil.Process(server_pid).children(recursive=True):
        if "Worker" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Worker"):
            return sorted(p.cpu_affinity())[0]
    raise RuntimeError("no vLLM worker found")


def neighbour(cpu: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", NEIGHBOUR,
                             str(seconds)], stdout=subprocess.PIPE, text=True)


def loops_per_s(proc: subprocess.Popen, seconds: float) -> float:
    out, _ = proc.communicate(timeout=seconds + 60)
    return int(out) / seconds


def run(mode: str, model: Path, prompts: list[list[int]], max_tokens: int, repeats: int,
        tmp: Path) -> dict:
    sampling = dict(max_tokens=max_tokens, temperature=1.0, seed=0)
    env = {"ROLLOUT_SIDECAR_ENGINE_WAIT": mode}
    with serve(model, tmp / f"{mode}.log", env=env) as server, server.client() as client:
        client.generate(prompt_token_ids=prompts, sampling=sampling)  # warm-up
        cpu = worker_cpu(server.proc.pid)
        alone, shared, rates = [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            r = client.generate(prompt_token_ids=prompts, sampling=sampling)
            alone.append(r.usage.completion_tokens / (time.perf_counter() - t))
            seconds = 4.0
            n = neighbour(cpu, seconds)
            t, tokens = time.perf_counter(), 0
            while time.perf_counter() - t < seconds:  # busy for the whole window
                tokens += client.generate(prompt_token_ids=prompts,
                                          sampling=sampling).usage.completion_tokens
            shared.append(tokens / (time.perf_counter() - t))
            rates.append(loops_per_s(n, seconds))
    return {"mode": mode, "cpu": cpu, "tok_s": median(alone), "tok_s_shared": median(shared),
            "neighbour": median(rates)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = default_model()
    prompts = [[5 + (i * 7 + j) % 200 for j in range(24)] for i in range(args.batch)]
    print(f"machine: {machine()}  cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-wait-") as tmp:
        results = [run(m, model, prompts, args.max_tokens, args.repeats, Path(tmp))
                   for m in ("spin", "nap")]
    cpu = results[0]["cpu"]
    free = loops_per_s(neighbour(cpu, 4.0), 4.0)
    rows = [[r["mode"], r["cpu"], r["tok_s"], r["tok_s_shared"], r["neighbour"],
             r["neighbour"] / free] for r in results]
    print(table(["engine_wait", "worker core", "tok/s alone", "tok/s with neighbour",
                 "neighbour loops/s", "neighbour / free core"], rows))
    spin, nap = results
    print(f"nap / spin: throughput alone {nap['tok_s'] / spin['tok_s']:.2f}, with the "
          f"neighbour {nap['tok_s_shared'] / spin['tok_s_shared']:.2f}; the neighbour's "
          f"loops {nap['neighbour'] / spin['neighbour']:.2f}x (free core: {free:.0f}/s)")


if __name__ == "__main__":
    main()
