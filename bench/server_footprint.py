"""Memory of a default CPU server's process tree: vLLM's host-share KV cache
(the CLI's default before the KV cache was sized to the model) vs the sized
default, side by side in one run.

Each variant is one `rollout-sidecar serve` of the default model with no
`VLLM_CPU_KVCACHE_SPACE` anywhere in its environment (removed from this
process's first; the launcher no longer adds it), measured twice: at /ready,
and after `--requests` /generate calls of 32 prompts x 64 tokens. Printed:

- KV GiB: the KV cache vLLM allocated, from its own log line ("... GiB for KV
  cache"), so this bench does not take the server's word for it;
- tree RSS: RSS summed over the server and every process it spawned (API
  process, vLLM's resource tracker, engine core, worker), as `ps` shows them;
  pages two processes share count twice;
- tree PSS: the same with shared pages split between their processes, which
  is what the tree costs the host;
- RSS / legacy: against the first row.

Variants: `legacy` passes `--gpu-memory-utilization 0.3`, which is exactly
what the CLI did by default before (the same engine arguments: vLLM-CPU then
reserves 0.3 of host memory less the worker's RSS); `sized` is the default
now; `small-kv` (`--kv-cache-gib 0.0625`) shows what the tree takes besides
its KV cache. One server at a time.

    .venv/bin/python bench/server_footprint.py [--requests 4] [--variants legacy,sized,small-kv]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

import httpx
import psutil
from _common import CACHE, default_model, machine, table

from rollout_sidecar.server.launcher import launch_server

KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
VARIANTS = {
    "legacy": ["--gpu-memory-utilization", "0.3"],
    "sized": [],
    "small-kv": ["--kv-cache-gib", "0.0625"],
}
TARGET_GIB = 2.0  # issue 26: a default server's tree under 2 GiB
GIB = 2**30
# vLLM's worker: "Explicitly set (1.50/23.54) GiB for KV cache" or "Auto set (...)".
KV_LINE = re.compile(r"(?:Auto|Explicitly) set \(([\d.]+)/[\d.]+\) GiB for KV cache")


def tree(pid: int) -> list[tuple[str, int, int]]:
    """(name, RSS, PSS) of `pid` and every process below it."""
    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            mem = p.memory_full_info()
            out.append((p.name(), mem.rss, mem.pss))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def generate(url: str, token: str, n: int) -> None:
    for i in range(n):
        r = httpx.post(url + "/generate", headers={"Authorization": f"Bearer {token}"},
                       timeout=600, json={"prompts": [f"prompt {i} {j}" for j in range(32)],
                                          "sampling": {"max_tokens": 64, "seed": i}})
        r.raise_for_status()


def run(name: str, args: list[str], requests: int, log_dir: Path) -> dict:
    log = log_dir / f"{name}.log"
    with launch_server(log=log, model=default_model(), args=args, own_session=True,
                       ready_timeout_s=900,
                       env={"ROLLOUT_SIDECAR_CACHE_DIR": str(CACHE)}) as s:
        assert KV_ENV not in s.env, f"{KV_ENV} reached the server"
        ready = tree(s.proc.pid)
        generate(s.url, s.api_token, requests)
        after = tree(s.proc.pid)
    kv = KV_LINE.findall(log.read_text(errors="replace"))
    return {"name": name, "kv_gib": float(kv[-1]) if kv else float("nan"),
            "rss_ready": sum(r for _, r, _ in ready), "rss": sum(r for _, r, _ in after),
            "pss": sum(p for *_, p in after), "procs": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    os.environ.pop(KV_ENV, None)
    log_dir = Path(tempfile.mkdtemp(prefix="footprint-"))
    print(machine())
    results = [run(v, VARIANTS[v], a.requests, log_dir) for v in a.variants.split(",")]
    base = results[0]["rss"]
    print(f"\ndefault model, {a.requests} x /generate (32 prompts x 64 tokens); logs in {log_dir}")
    print(table(["variant", "KV GiB", "tree RSS GiB (ready)", "tree RSS GiB", "tree PSS GiB",
                 f"RSS / {results[0]['name']}", f"RSS < {TARGET_GIB:g} GiB"],
                [[r["name"], r["kv_gib"], r["rss_ready"] / GIB, r["rss"] / GIB, r["pss"] / GIB,
                  r["rss"] / base, "yes" if r["rss"] < TARGET_GIB * GIB else "no"]
                 for r in results]))
    print("\nper process, after the requests (RSS MiB):")
    for r in results:
        print(f"  {r['name']:>9}: " + ", ".join(f"{n} {rss / 2**20:.0f}"
                                               for n, rss, _ in r["procs"]))


if __name__ == "__main__":
    main()
