"""What each bucket's integrity check adds to a whole dense push (issue 44).

One run, three servers of the same 100M bf16 checkpoint side by side, each
with the check computed a different way on both sides (the trainer in this
process, the server's workers in theirs):

- `none`: the CRC-32 is a constant, so the push moves and loads the same
  bytes with no check work at all (the baseline the check is measured against);
- `zlib`: zlib's CRC-32, the check before issue 44;
- `isal`: ISA-L's CRC-32, what ships (bucket_check.py).

How the servers get theirs: a `sitecustomize.py` in a temporary directory on
their `PYTHONPATH` replaces `bucket_check._crc32` as every Python process
starts (the API process, vLLM's engine core and workers), chosen by
`ROLLOUT_SIDECAR_BENCH_CRC`. Production code has no such switch. Dense pushes
over gloo on loopback (`delta=False`, no probe), interleaved
none/zlib/isal so drift hits each alike; medians of `--repeats` after a
warm-up each; a block per `--fanouts` (a broadcast moves a bucket whole, so
the receiver checks it after it arrived; a chain moves it in 16 MiB pieces,
each checked while the next arrives).

    .venv/bin/python bench/push_checks.py [--repeats 7] [--bucket-mb 256]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from _common import build_llama, machine, median, serve, table

SIZE = (1024, 2816, 8)  # bench/push.py's 100m: 103M parameters, 207 MB in bf16
VARIANTS = ("none", "zlib", "isal")
ENV = "ROLLOUT_SIDECAR_BENCH_CRC"
SITECUSTOMIZE = f'''
import os
_how = os.environ.get("{ENV}")
if _how in ("none", "zlib"):
    import zlib
    from rollout_sidecar.protocol.data_plane import bucket_check
    bucket_check._crc32 = (lambda data, running=0: 0) if _how == "none" else zlib.crc32
'''


def _no_check(data: Any, running: int = 0) -> int:
    return 0


@contextlib.contextmanager
def trainer_check(how: str) -> Any:
    """This process's CRC-32 for one push: the same as its server's."""
    from rollout_sidecar.protocol.data_plane import bucket_check

    shipped = bucket_check._crc32
    bucket_check._crc32 = {"none": _no_check, "zlib": zlib.crc32, "isal": shipped}[how]
    try:
        yield
    finally:
        bucket_check._crc32 = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--fanouts", default="broadcast,chain",
                    help="comma list: each a block of pushes to all three servers")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    ckpt = build_llama(*SIZE)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    with torch.no_grad():  # anonymous memory, as a trainer's weights are
        for p in model.parameters():
            p.data = p.data.clone()
    fanouts = args.fanouts.split(",")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    nbytes = 0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        servers = {v: stack.enter_context(serve(ckpt, Path(tmp) / f"server-{v}.log",
                                                env={ENV: v, "PYTHONPATH": pythonpath}))
                   for v in VARIANTS}
        for fanout in fanouts:
            nbytes = pushes(servers, model, fanout, args, runs)
    print(f"\nmachine: {machine()}; {nbytes / 1e6:.0f} MB per push, {args.bucket_mb:g} MiB "
          f"buckets, median of {args.repeats}\n")
    rows = []
    first = median([t["total_s"] for t in runs[fanouts[0], "none"]])
    for fanout in fanouts:
        base = median([t["total_s"] for t in runs[fanout, "none"]])
        for v in VARIANTS:
            m = {k: median([t.get(k, 0.0) for t in runs[fanout, v]])
                 for k in ("total_s", "gather_send_s", "server_check_s", "commit_s")}
            # Paired: each push against the none push of its own round, so
            # drift between rounds (other work on 2 cores) cancels.
            paired = median([t["total_s"] / n["total_s"]
                             for t, n in zip(runs[fanout, v], runs[fanout, "none"], strict=True)])
            rows.append([fanout, v, m["total_s"], m["gather_send_s"], m["server_check_s"],
                         m["commit_s"], f"{m['total_s'] / base:.3f}x", f"{paired:.3f}x",
                         f"{m['total_s'] / first:.3f}x"])
    print(table(["fanout", "check", "push s", "gather+send s", "server check s", "commit s",
                 "push / none", "paired / none", f"push / {fanouts[0]} none"], rows))


def pushes(servers: dict[str, Any], model: torch.nn.Module, fanout: str,
           args: argparse.Namespace, runs: dict[tuple[str, str], list[dict[str, float]]]
           ) -> int:
    """One block: a pusher per server with this fan-out, pushes interleaved
    none/zlib/isal, a warm-up each; the pushers release their servers at the
    end, so the next block connects at once."""
    from rollout_sidecar.trainer import WeightPusher

    nbytes = 0
    with contextlib.ExitStack() as stack:
        pushers = {v: stack.enter_context(WeightPusher(
            s.url, admin_token=s.admin_token, transport="gloo", bucket_mb=args.bucket_mb,
            fanout=fanout, probe=False, delta=False)) for v, s in servers.items()}
        for i in range(args.repeats + 1):  # the first connects and allocates: warm-up
            for v in VARIANTS:
                with trainer_check(v):
                    r = pushers[v].push(model, version=servers[v].weight_version() + 1)
                assert r.encoding == "dense", r.encoding
                nbytes = r.nbytes
                if i:
                    runs.setdefault((fanout, v), []).append(r.timings)
            if i:
                print(f"{fanout} round {i}: " + ", ".join(
                    f"{v} {runs[fanout, v][-1]['total_s']:.3f}s" for v in VARIANTS), flush=True)
    return nbytes

if __name__ == "__main__":
    main()
