"""How often a rank aborts in interpreter teardown right after an object
collective: torch's `dist.all_gather_object` against ours
(`rollout_sidecar.trainer.collectives.all_gather_object`), side by side in one
run.

Each run is a 2-rank torchrun (gloo) that shards a small model with FSDP2,
gathers a full state dict, gathers one object from every rank, then barriers,
destroys the group and returns, as the test workers do (tests/rank_worker.py).
FSDP2's mesh keeps the group's gloo threads alive into teardown, so a worker
thread that still holds the collective's tensors takes the GIL to let go after
finalization began: `pthread_exit` inside a destructor, "terminate called
without an active exception", SIGABRT. Ours waits (`settled`) until no gloo
thread holds its tensors. Measured on the 2-core CI-like machine: torch's 4
aborts in 40 runs, ours 0 in 40 (the fidelity tests' rank 1 hit it twice in one
CI run).

    .venv/bin/python bench/exit_after_collective.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

WORKER_ENV = "ROLLOUT_SIDECAR_EXIT_BENCH_GATHER"


def worker(gather: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from rollout_sidecar.trainer.collectives import all_gather_object

    dist.init_process_group("gloo")
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 64)).sum().backward()
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if gather == "torch":
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, dist.get_rank())  # unsettled: the baseline
    else:
        got = all_gather_object(dist.get_rank())
    assert got == list(range(dist.get_world_size())), got
    dist.barrier()
    dist.destroy_process_group()
    if dist.is_torchelastic_launched() and os.environ.get("RANK") == "1":
        time.sleep(random.random() * 0.05)  # the ranks reach teardown apart


def run_once(gather: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "--local-addr", "127.0.0.1", __file__]
    p = subprocess.run(cmd, env=dict(os.environ, **{WORKER_ENV: gather}), capture_output=True,
                       text=True, timeout=120)
    return p.returncode, p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    aborts = {"torch": 0, "settled": 0}
    for i in range(args.runs):
        for gather in aborts:  # interleaved: both see the same machine load
            rc, err = run_once(gather)
            if rc != 0:
                aborts[gather] += 1
                if "terminate called without an active exception" not in err:
                    print(f"run {i} ({gather}) failed otherwise:\n{err[-2000:]}")
        print(f"\r{i + 1}/{args.runs} runs", end="", flush=True)
    print()
    for gather, n in aborts.items():
        print(f"{gather:>8}: {n} of {args.runs} runs aborted in teardown")


if __name__ == "__main__":
    gather = os.environ.get(WORKER_ENV)
    if gather:
        worker(gather)
    else:
        main()
