"""The skeleton every torchrun test worker shares.

tests/processes.py's `torchrun` starts the ranks (faulthandler armed, a
deadline); each worker module then hands its body to `main`, which parses the
arguments (always `--out`, rank 0's JSON report), forms the gloo group, seeds
torch, runs the body on every rank, has rank 0 write what the body returned,
and ends the group: a barrier first, so no rank tears the group down while a
peer still uses it, then a plain return. No `os._exit`: a teardown that
aborts must fail the test, as it fails a user's job (tests/e2e/test_clean_exit.py).

    def arguments(ap): ap.add_argument("--url", required=True)
    def body(args, rank): ...; return report      # rank 0's report is written
    if __name__ == "__main__": rank_worker.main(body, arguments)

The pytest side reads the report and asserts. Most tests run a worker as a job
of the session's ranks (tests/rank_pool.py runs `arguments` and `body` as
`main` does), so a body leaves the process as it found it: what it patches it
restores (an ExitStack, as tests/e2e/push_worker.py does). Two kinds of worker keep their
own `main` on purpose: tests/e2e/exit_worker.py is a user's script, written as
one would be, and the TRL workers (tests/integrations/) run under TRL and
accelerate, which form the process group themselves.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Body = Callable[[argparse.Namespace, int], Any]


def main(body: Body, arguments: Callable[[argparse.ArgumentParser], None] | None = None,
         *, seed: int = 0) -> None:
    """Run `body(args, rank)` on every rank of a gloo group; rank 0 writes its
    return value to `--out` as JSON."""
    args = parse(arguments)
    dist.init_process_group("gloo")
    run(body, args, dist.get_rank(), seed=seed)
    dist.destroy_process_group()


def parse(arguments: Callable[[argparse.ArgumentParser], None] | None,
          argv: list[str] | None = None) -> argparse.Namespace:
    """`--out` and the worker's own arguments, from `argv` (default: sys.argv)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="where rank 0 writes its JSON report")
    if arguments is not None:
        arguments(ap)
    return ap.parse_args(argv)


def run(body: Body, args: argparse.Namespace, rank: int, *, seed: int = 0) -> None:
    """`body` on this rank of the formed group; rank 0 writes the report, and
    a barrier keeps every rank until all are done with the group."""
    torch.manual_seed(seed)
    report = body(args, rank)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.barrier()


def server_info(url: str) -> tuple[Any, dict]:
    """(rank 0's `GenerationClient` or None elsewhere, the server's /info as a
    dict on every rank): one rank asks, the others are told."""
    from rollout_sidecar.client import GenerationClient
    from rollout_sidecar.trainer.collectives import broadcast_object

    client = GenerationClient(url) if dist.get_rank() == 0 else None
    return client, broadcast_object(client.info().model_dump() if client else None)
