"""Push time to one replica vs two, side by side in one run.

Two real servers serve the same checkpoint, each pinned to its own core (as
on its own node; `--shared-cores` lets them contend). One trainer pushes with
`WeightPusher(delta=False)` (gloo; the same weights again would go as a
delta of nothing) to replica A alone, then to A and B together (one
group, all-or-nothing commit), with each fan-out: `broadcast` (gloo's
binomial tree: rank 0 sends each bucket once per tree level) and `chain`
(rank 0 sends it once; each receiver relays it to the next, piece by piece).
A warm-up push each (connect and allocate), then `--repeats` timed pushes;
medians and ratios are printed.

Two networks:
- loopback (default): every byte moves by CPU copies on 2 shared cores, so
  two receivers cost about twice the copying however the bytes are routed;
  the floor for that, the same bytes through the same group and fan-out with
  nothing else (raw_fanout.py), is measured in the same run (`raw gloo s`);
- `--link 2gbit`: the trainer and each replica in their own network
  namespace, each node's upload capped by `tc` (netns.py; needs root), as
  pods on a cluster network, where the trainer's NIC is what a tree pays
  twice for.

Target (issue 10): two replicas <= 1.3x one.

    .venv/bin/python bench/push_replicas.py [--size 100m] [--repeats 5] [--link 2gbit]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import build_llama, load, machine, median, serve, table
from push import SIZES, load_trainer_model

KEYS = ("total_s", "gather_send_s", "server_check_s", "server_commit_s")
# (label, replicas pushed to, fan-out)
CONFIGS = [("1 replica", 1, "broadcast"), ("2, broadcast", 2, "broadcast"),
           ("2, chain", 2, "chain")]


def timed(urls: list[str], token: str, model: torch.nn.Module, version: int, repeats: int,
          bucket_mb: float, fanout: str) -> tuple[dict[str, float], int]:
    from rollout_sidecar.trainer import WeightPusher

    # delta=False: the same weights again would go as a delta of nothing.
    pusher = WeightPusher(urls, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          probe=False, fanout=fanout, delta=False)
    runs = []
    try:
        for i in range(repeats + 1):  # the first connects and allocates: warm-up
            r = pusher.push(model, version=version)
            assert [o.weight_version for o in r.replicas] == [version] * len(urls), r.replicas
            assert r.encoding == "dense", r.encoding
            version += 1
            if i:
                runs.append(r.timings)
    finally:
        pusher.close()
    return {k: median([r.get(k, 0.0) for r in runs]) for k in KEYS}, version


def measure(urls: list[str], token: str, args: argparse.Namespace) -> dict[str, dict]:
    """Every config, in this process (the trainer)."""
    torch.set_num_threads(args.threads)
    model = load_trainer_model(build_llama(*SIZES[args.size]), getattr(torch, args.trainer_dtype))
    res, v = {}, 1
    for label, n, fanout in CONFIGS:
        res[label], v = timed(urls[:n], token, model, v, args.repeats, args.bucket_mb, fanout)
    return res


def measure_in(prefix: list[str], urls: list[str], token: str,
               args: argparse.Namespace) -> dict[str, dict]:
    """`measure` in a child process run under `prefix` (the trainer's node)."""
    out = args.workdir / "replicas-result.json"
    out.unlink(missing_ok=True)
    cmd = [*prefix, sys.executable, __file__, "--measure", ",".join(urls), "--out", str(out),
           "--size", args.size, "--repeats", str(args.repeats), "--bucket-mb",
           str(args.bucket_mb), "--trainer-dtype", args.trainer_dtype,
           "--threads", str(args.threads)]
    subprocess.run(cmd, check=True, timeout=1800, env=dict(
        os.environ, ROLLOUT_SIDECAR_ADMIN_TOKEN=token, GLOO_SOCKET_IFNAME="eth0"))
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of the pushing process (see README, push.py)")
    ap.add_argument("--shared-cores", action="store_true",
                    help="let both replicas use every core (default: one core each)")
    ap.add_argument("--link", help="tc rate of each node's upload, e.g. 2gbit: trainer and "
                    "replicas in network namespaces (root only)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:  # the trainer's half, on its own node
        res = measure(args.measure.split(","), os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"], args)
        Path(args.out).write_text(json.dumps(res))
        return
    print(machine(), flush=True)
    ckpt = build_llama(*SIZES[args.size])
    params = sum(p.numel() for p in load_trainer_model(ckpt, torch.bfloat16).parameters())
    # Both replicas share tokens (as a Deployment's pods do), and connection
    # leases are off: each config's pusher takes over from the last at once.
    env = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "0"}
    token = env["ROLLOUT_SIDECAR_ADMIN_TOKEN"]
    ncores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        if args.link:
            from netns import exec_prefix, nodes

            ips = stack.enter_context(nodes(["t", "a", "b"], args.link))
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        servers = [stack.enter_context(serve(
            ckpt, args.workdir / f"replica-{n}.log", env=env,
            cpus=None if args.shared_cores else str(i % ncores),
            prefix=exec_prefix(n) if args.link else None, host=ips[n] if args.link else None))
            for i, n in enumerate("ab")]
        urls = [s.url for s in servers]
        print(f"{args.size}: {params / 1e6:.1f}M params; network: "
              f"{'each node uploads at ' + args.link if args.link else 'loopback'}; {load()}",
              flush=True)
        t0 = time.perf_counter()
        res = measure_in(exec_prefix("t") if args.link else [], urls, token, args)
    if not args.link:  # the bytes alone, same route, after the servers stopped
        from raw_fanout import raw_seconds

        for label, n, fanout in CONFIGS:
            res[label]["raw gloo s"] = raw_seconds(n, fanout, params * 2,
                                                   int(args.bucket_mb * 2**20), args.repeats)
    wall = time.perf_counter() - t0
    one = res["1 replica"]
    labels = [c[0] for c in CONFIGS]
    keys = [*KEYS, *(["raw gloo s"] if not args.link else [])]
    rows = [[k, *(f"{res[c][k]:.3f}" for c in labels),
             *(f"{res[c][k] / one[k]:.2f}x" if one[k] else "-" for c in labels[1:])]
            for k in keys]
    print(f"\nmedian of {args.repeats} pushes, bucket {args.bucket_mb:g} MiB, "
          f"{params * 2 / 2**20:.0f} MiB on the wire (bf16), replicas on "
          f"{'shared cores' if args.shared_cores else 'one core each'}; {wall:.0f}s; {load()}")
    print(table(["seconds", *labels, *(f"{c} / 1" for c in labels[1:])], rows))
    for label in labels[1:]:
        ratio = res[label]["total_s"] / one["total_s"]
        print(f"{label} / 1 replica, whole push: {ratio:.2f}x (target <= 1.3x: "
              f"{'met' if ratio <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main()
