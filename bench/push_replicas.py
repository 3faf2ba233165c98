"""Push time to one replica vs two, side by side in one run.

Two real servers serve the same checkpoint. One trainer process pushes with
`WeightPusher` (gloo) first to replica A alone, then to A and B together (one
broadcast group, all-or-nothing commit): a warm-up push each (connect and
allocate), then `--repeats` timed pushes; medians and the ratio are printed.

Target (issue 10): two replicas <= 1.3x one. Each bucket leaves the trainer
once either way; what grows is the fan-out of the broadcast and each replica's
own CRC and load, which on a GPU cluster run on separate machines. On a small
CPU box both servers share the cores with the trainer, so the ratio measured
there is an upper bound.

    .venv/bin/python bench/push_replicas.py [--size 100m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import time
from pathlib import Path

import torch
from _common import build_llama, load, machine, median, serve, table
from push import SIZES, load_trainer_model

KEYS = ("total_s", "gather_send_s", "server_verify_s", "server_commit_s")


def timed(urls: list[str], token: str, model: torch.nn.Module, version: int, repeats: int,
          bucket_mb: float) -> tuple[dict[str, float], int]:
    from rollout_sidecar.trainer import WeightPusher

    pusher = WeightPusher(urls, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          verify=False)
    runs = []
    try:
        for i in range(repeats + 1):  # the first connects and allocates: warm-up
            r = pusher.push(model, version=version)
            assert [o.weight_version for o in r.replicas] == [version] * len(urls), r.replicas
            version += 1
            if i:
                runs.append(r.timings)
    finally:
        pusher.close()
    return {k: median([r.get(k, 0.0) for r in runs]) for k in KEYS}, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    args = ap.parse_args()
    print(machine(), flush=True)
    ckpt = build_llama(*SIZES[args.size])
    model = load_trainer_model(ckpt, torch.float32)
    params = sum(p.numel() for p in model.parameters())
    # Both replicas share tokens (as a Deployment's pods do), and connection
    # leases are off: the second pusher takes over from the first at once.
    env = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "0"}
    token = env["ROLLOUT_SIDECAR_ADMIN_TOKEN"]
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(serve(ckpt, args.workdir / f"replica-{n}.log", env=env))
                for n in "ab")
        print(f"{args.size}: {params / 1e6:.1f}M params; {load()}", flush=True)
        t0 = time.perf_counter()
        one, v = timed([a.url], token, model, 1, args.repeats, args.bucket_mb)
        two, _ = timed([a.url, b.url], token, model, v, args.repeats, args.bucket_mb)
        wall = time.perf_counter() - t0
    rows = [[k, f"{one[k]:.3f}", f"{two[k]:.3f}",
             f"{two[k] / one[k]:.2f}x" if one[k] else "-"] for k in KEYS]
    print(f"\nmedian of {args.repeats} pushes, bucket {args.bucket_mb:g} MiB, "
          f"{params * 2 / 2**20:.0f} MiB on the wire (bf16); {wall:.0f}s")
    print(table(["seconds", "1 replica", "2 replicas", "ratio"], rows))
    ratio = two["total_s"] / one["total_s"]
    print(f"\n2 replicas / 1 replica, whole push: {ratio:.2f}x (target <= 1.3x: "
          f"{'met' if ratio <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main()
