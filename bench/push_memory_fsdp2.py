"""Every rank's extra peak memory while an FSDP2 model is gathered and packed:
row blocks (the default) vs `full_tensor()` on every parameter.

torchrun, 2 ranks, gloo, a model with a real vocabulary (a 151936 x --hidden
embedding and lm_head, plus a few layers), each module `fully_shard`-ed. Rank
0 plans the buckets and packs and sends them with the pusher's own
`BucketSender`, to a transport that drops the bytes (only memory is measured,
as in push_memory.py); rank 1 takes part in every gather, as it does inside
`WeightPusher.push`. Each variant is a fresh torchrun, so the first
allocation of the send buffers counts. Method: VmHWM reset via clear_refs
(see push.py), extra = peak - RSS before the push.

Target (issue 10): rank 0's extra peak <= 3 buckets, with a 150k vocabulary.

    .venv/bin/python bench/push_memory_fsdp2.py [--hidden 1024 --bucket-mb 16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from push_memory import VOCAB, DropTransport
from push_memory import build as build_plain
from torch import nn

from rollout_sidecar.trainer.collectives import all_gather_object

MiB = 2**20
WIRE = torch.bfloat16


def build(hidden: int, layers: int, dtype: torch.dtype) -> nn.Module:
    """push_memory.py's model, each layer and then the whole `fully_shard`-ed."""
    from torch.distributed.fsdp import fully_shard

    m = build_plain(hidden, layers, dtype)
    for layer in m.layers:
        fully_shard(layer)
    return fully_shard(m)


def worker(args: argparse.Namespace) -> None:
    from _common import PeakRss

    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors, param_plan
    from rollout_sidecar.trainer.pack.buckets import plan_buckets
    from rollout_sidecar.trainer.pack.sender import BucketSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.hidden, args.layers, getattr(torch, args.trainer_dtype))
    bucket = int(args.bucket_mb * MiB)
    block_bytes = bucket // 2 if args.row_blocks else None  # as WeightPusher.push does
    plan = param_plan(model)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed init memory cannot hide a push
    dist.barrier()
    with PeakRss() as m:
        t0 = time.perf_counter()
        gathers = iter_full_tensors(model, None, (), block_bytes)
        if rank == 0:
            buckets = plan_buckets(plan, WIRE, bucket)
            sender = BucketSender()
            _, err = sender.send_all(buckets, gathers, DropTransport(), ["bench"])
            assert err is None, err
        for _ in gathers:
            pass
        elapsed = time.perf_counter() - t0
    res = dict(rank=rank, extra=m.extra, seconds=elapsed, method=m.method,
               largest=max(p.numel() * p.element_size() for p in model.parameters()))
    out = all_gather_object(res)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, row_blocks: bool) -> list[dict]:
    out = Path(f"/tmp/rollout-sidecar-bench/fsdp2-memory-{int(row_blocks)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(args.port + int(row_blocks)), __file__, "--worker",
           "--out", str(out), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--bucket-mb", str(args.bucket_mb), "--trainer-dtype", args.trainer_dtype]
    cmd += ["--row-blocks"] if row_blocks else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    subprocess.run(cmd, check=True, timeout=900, env=env)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--trainer-dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row-blocks", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from _common import load, machine, table

    print(f"machine: {machine()}", flush=True)
    itemsize = getattr(torch, args.trainer_dtype).itemsize
    print(f"model: embedding and lm_head {VOCAB} x {args.hidden} "
          f"({VOCAB * args.hidden * itemsize / MiB:.0f} MiB each in {args.trainer_dtype}), "
          f"{args.layers} layers, FSDP2 over 2 ranks (gloo); bf16 on the wire; "
          f"bucket {args.bucket_mb:g} MiB", flush=True)
    t0 = time.perf_counter()
    res = {rb: run(args, rb) for rb in (False, True)}
    bucket = args.bucket_mb * MiB
    rows = []
    for rb, ranks in res.items():
        for r in ranks:
            rows.append(["row blocks" if rb else "full_tensor()", r["rank"],
                         f"{r['extra'] / MiB:.1f}", f"{r['extra'] / bucket:.2f}",
                         f"{r['seconds']:.2f}"])
    print(f"\n== extra peak RSS during one gather + pack (fresh torchrun each; "
          f"{res[True][0]['method']}) ==")
    print(table(["gather", "rank", "extra peak MiB", "extra / bucket", "seconds"], rows))
    before, after = res[False][0]["extra"], res[True][0]["extra"]
    met = "met" if after <= 3 * bucket else "NOT met"
    print(f"\nrank 0: full_tensor() / row blocks = {before / after:.2f}x; row blocks "
          f"{after / bucket:.2f} buckets (target <= 3: {met})")
    print(f"bench wall time: {time.perf_counter() - t0:.0f}s; at the end {load()}")


if __name__ == "__main__":
    main()
