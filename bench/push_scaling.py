"""How a push's cost grows: measured over model size, trainer ranks and
replicas on capped links, a cost model fitted to it, and what that model
projects for large models on GPU clusters.

Every trainer rank and every replica is a node of its own (a network
namespace, its upload capped by tc: netns.py; needs root), as in
bench/push_links.py, whose trainer rank this reuses. The push is the
default one (`WeightPusher()` with `delta=False, probe=False`: own rows
where there are several ranks), dense, bf16 on the wire. Measured per
configuration, medians of `--repeats` after a warm-up: the push's seconds
and the bytes out of each trainer node and each replica node.

The cost model, fitted by least squares over every configuration, each
coefficient at least 0:

    push_s = busiest_link_s + fixed + trainer_pass * (W / N) + server_pass * W
             + more_replicas * W * (R - 1)

busiest_link_s: the bytes of the busiest node's upload over its rate, taken
at face value (a push cannot beat its busiest link); W / N: the bytes each
trainer rank packs; W: the bytes a replica stages, checks and loads;
W * (R - 1): what each further replica adds here, where every replica and
rank shares this machine's two cores (on a cluster each replica has a host
of its own, and its relaying is in the busiest link). A term fitted below 0
is dropped (it is 0). Printed: each coefficient, and each measured point
against the fit. `--points FILE` fits and prints the points a run saved
(`scaling-points.json` in the work folder) without measuring again.

The projection (labelled as such, not measured): the fitted fixed cost; the
wire at 100 and 400 Gbit/s per node, the busiest link being a receiving
host's, which takes the whole model W whatever the trainer (a trainer node
uploads W / nodes); the per-byte passes at the pinned host copy rate
docs/benchmarks.md measured on an H200 (51 GiB/s) instead of this machine's
CPU rates, 8 GPUs a node copying side by side: the trainer's over W / nodes,
a replica's (TP 8 on one host, each worker loading its shard from the shared
copy) over W. Beside it the anchors issue 58 cites.

    sudo .venv/bin/python bench/push_scaling.py [--link 400mbit] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import time
from pathlib import Path

import torch
from _common import build_llama, load, machine, median, serve, table
from push import SIZES
from push_links import REPLICAS, _bits_per_s, run_config

# (size, trainer ranks, replicas): every ranks x replicas pair at 100m, and
# the sizes (25m to 250m: 10x) at two of those pairs.
GRID = [("100m", r, p) for r in (1, 2, 4) for p in (1, 2, 3)] + [
    (s, r, p) for s in ("25m", "50m", "250m") for r, p in ((2, 1), (4, 2))]
H2D = 51 * 2**30  # bytes/s: a pinned host copy on an H200 (docs/benchmarks.md)
GPUS = 8  # a node's, copying side by side
MODELS = {"8B": 8.0e9, "70B": 70.6e9, "235B": 235e9}  # parameters, bf16 on the wire
ANCHORS = ["Perplexity: a 1T model in 1.3 s, every trainer GPU writing its own part",
           "SkyRL sharded pull: Qwen3-235B in 3.54 s (broadcast: 64.7 s)",
           "verl multi-sender NCCL: a 27B push from 5.03 to 1.79 s"]


def measure(args: argparse.Namespace) -> list[dict]:
    from netns import exec_prefix, nodes

    rate = _bits_per_s(args.link) / 8
    env = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "0"}
    names = [f"t{r}" for r in range(4)] + list(REPLICAS)
    points, version = [], 0
    with nodes(names, args.link) as ips:
        for size in dict.fromkeys(s for s, _, _ in GRID):
            ckpt = build_llama(*SIZES[size])
            needed = max(p for s, _, p in GRID if s == size)
            with contextlib.ExitStack() as stack:
                servers = [stack.enter_context(serve(
                    ckpt, args.workdir / f"scaling-{size}-{n}.log",
                    env={**env, "GLOO_SOCKET_IFNAME": "eth0"}, prefix=exec_prefix(n),
                    host=ips[n])) for n in REPLICAS[:needed]]
                for s, ranks, replicas in GRID:
                    if s != size:
                        continue
                    version += 1000
                    args.size = size
                    per_rank, replica_tx = run_config(
                        ips, [v.url for v in servers[:replicas]], ranks, "default", version,
                        env, args)
                    points.append(_point(size, ranks, replicas, per_rank, replica_tx, rate))
                    print(f"  {size}, {ranks} rank(s), {replicas} replica(s): "
                          f"{points[-1]['push_s']:.2f} s", flush=True)
    return points


def _point(size: str, ranks: int, replicas: int, per_rank: list[list[dict]],
           replica_tx: list[float], rate: float) -> dict:
    rows = per_rank[0]
    links = [median([r["push_bytes"] + r["gather_bytes"] for r in mine]) for mine in per_rank]
    links += replica_tx
    return {"size": size, "ranks": ranks, "replicas": replicas, "W": rows[0]["nbytes"],
            "push_s": median([r["push_s"] for r in rows]),
            "busiest_s": max(links) / rate, "busiest_mb": max(links) / 1e6,
            "own_rows": rows[0]["own_rows"], "senders": rows[0]["senders"]}


def features(p: dict) -> list[float]:
    """The model's terms beside the busiest link (module docstring): 1, GB a
    trainer rank packs, GB a replica loads, GB each further replica adds."""
    gb = p["W"] / 1e9
    return [1.0, gb / p["ranks"], gb, gb * (p["replicas"] - 1)]


def fit(points: list[dict]) -> list[float]:
    """Least squares of what the busiest link leaves, with every coefficient
    at least 0 (a cost is never negative): a term whose coefficient comes
    out below 0 is dropped and the rest fitted again (the terms are few, so
    this active set settles fast)."""
    x = torch.tensor([features(p) for p in points], dtype=torch.float64)
    y = torch.tensor([p["push_s"] - p["busiest_s"] for p in points], dtype=torch.float64)
    keep = list(range(x.shape[1]))
    while True:
        sol = torch.linalg.lstsq(x[:, keep], y[:, None]).solution[:, 0].tolist()
        if min(sol) >= 0:
            coef = [0.0] * x.shape[1]
            for i, c in zip(keep, sol, strict=True):
                coef[i] = c
            return coef
        keep.pop(min(range(len(sol)), key=sol.__getitem__))


def predict(coef: list[float], p: dict) -> float:
    return p["busiest_s"] + sum(c * f for c, f in zip(coef, features(p), strict=True))


def projection(coef: list[float]) -> list[list[object]]:
    """Labelled projection: the fitted fixed cost, the wire at GPU-cluster
    rates (a receiving host takes all of W), passes at the H2D copy rate."""
    fixed = max(coef[0], 0.0)
    rows = []
    for name, params in MODELS.items():
        w = params * 2
        for gbit in (100, 400):
            link = gbit * 1e9 / 8
            cells = []
            for nodes_ in (8, 16, 32, 64):
                wire = max(w / nodes_, w) / link  # the receiving host is the busiest link
                passes = (w / nodes_) / (GPUS * H2D) + w / (GPUS * H2D)
                cells.append(f"{fixed + wire + passes:.1f}")
            rows.append([name, f"{w / 1e9:.0f} GB", f"{gbit} Gbit/s", *cells,
                         f"{w / link:.1f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", default="400mbit", help="tc rate of each node's upload")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    ap.add_argument("--points", type=Path, help="fit a saved run's points, measuring nothing")
    args = ap.parse_args()
    print(machine(), flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.points:
        points = json.loads(args.points.read_text())
    else:
        points = measure(args)
        (args.workdir / "scaling-points.json").write_text(json.dumps(points))
    coef = fit(points)
    print(f"\nthe default push (own rows where several ranks send), dense, bf16; each node "
          f"uploads at {args.link}; bucket {args.bucket_mb:g} MiB; medians of {args.repeats}; "
          f"{time.perf_counter() - t0:.0f}s; {load()}\n")
    rows = []
    for p in points:
        guess = predict(coef, p)
        rows.append([p["size"], f"{p['W'] / 1e6:.0f}", p["ranks"], p["replicas"], p["senders"],
                     "yes" if p["own_rows"] else "no", f"{p['busiest_mb']:.0f}",
                     f"{p['busiest_s']:.2f}", f"{p['push_s']:.2f}",
                     f"{p['push_s'] / p['busiest_s']:.2f}x", f"{guess:.2f}",
                     f"{(guess - p['push_s']) / p['push_s']:+.0%}"])
    print(table(["model", "W MB", "ranks", "replicas", "senders", "own rows",
                 "busiest link MB", "its wire s", "push s", "push / wire", "fit s", "fit error"],
                rows))
    errors = [abs(predict(coef, p) - p["push_s"]) / p["push_s"] for p in points]
    print(f"\nfit: push_s = busiest link s + {coef[0]:.3f} s + {coef[1]:.2f} s/GB x W/N + "
          f"{coef[2]:.2f} s/GB x W + {coef[3]:.2f} s/GB x W x (R - 1); |error| median "
          f"{median(errors):.0%}, max {max(errors):.0%}")
    print("\nPROJECTION, not measured: bf16, own rows from every trainer node, one receiving "
          "host per replica taking all of W; the fitted fixed cost, the wire, and each side's "
          "pass at 51 GiB/s a GPU (pinned host copy, H200), 8 GPUs a node; push s by "
          "trainer nodes")
    print(table(["model", "W", "link", "8 nodes", "16 nodes", "32 nodes", "64 nodes",
                 "W over one link s"], projection(coef)))
    print("\nanchors (issue 58): " + "; ".join(ANCHORS))


if __name__ == "__main__":
    main()
