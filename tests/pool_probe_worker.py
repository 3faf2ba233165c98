"""A worker for tests/test_rank_pool.py: reports what a job sees of its
process (pid, the PROBE variable, the world), or fails on rank 1."""

from __future__ import annotations

import argparse
import os

from rollout_sidecar.trainer.collectives import all_gather_object
from tests.rank_worker import main


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--fail", action="store_true", help="rank 1 raises")


def body(args: argparse.Namespace, rank: int) -> dict:
    print(f"rank {rank} says hello", flush=True)
    if args.fail and rank == 1:
        raise RuntimeError("rank 1 was told to fail")
    return {"pids": all_gather_object(os.getpid()), "probe": os.environ.get("PROBE")}


if __name__ == "__main__":
    main(body, arguments)
