"""Per-node links: one sender against every rank sending, side by side in one run.

Each trainer rank and each replica is a node of its own: a network namespace
whose upload is capped by `tc` (netns.py; needs root), as pods on a cluster
network, where each node's NIC is the limit. The trainer is FSDP2 over gloo
across those nodes, so its gathers cross the same capped links as between
real nodes. For 2 and 4 ranks, 1 and 2 replicas, three ways to send:
"one" (`senders="one"`: rank 0 sends every bucket, gathered to it), "all"
(`own_rows=False`: every rank gathers every tensor whole and sends its share
of the buckets) and "own" (the default since issue 58: every rank sends its
own FSDP2 rows, nothing gathered), it measures a dense push (`delta=False`): its time, and
the bytes that leave each trainer node, split into the wrapper's gathers
(the same gathers drained alone, just before) and the push's own, and the
bytes that leave each replica (the chain relays every bucket from the first
replica to the second). A warm-up push first (connect, allocate), then
`--repeats` measured ones; medians.

Targets (issue 44): with N ranks the push's own bytes out of the busiest
trainer link <= 1.2 x model bytes / N, and the whole push within 1.3 x the
time the busiest link (a trainer's or a replica's) needs for everything it
carries.

    sudo .venv/bin/python bench/push_links.py [--size 100m] [--link 1gbit] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import build_llama, load, machine, median, serve, table
from push import SIZES, load_trainer_model

REPLICAS = "abc"  # the replicas' node names
# This node's upload: `ip netns exec` mounts the namespace's own sysfs.
TX = Path("/sys/class/net/eth0/statistics/tx_bytes")


def _tx() -> int:
    return int(TX.read_text())


def worker(args: argparse.Namespace) -> None:
    """One trainer rank on its own node (env: RANK, WORLD_SIZE, MASTER_*)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rollout_sidecar.trainer import WeightPusher
    from rollout_sidecar.trainer.collectives import all_gather_object
    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = load_trainer_model(build_llama(*SIZES[args.size]), torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    pusher = WeightPusher(args.urls.split(","), os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"],
                          delta=False, probe=False, senders="one" if args.way == "one" else "all",
                          own_rows=args.way in ("own", "default"), bucket_mb=args.bucket_mb)
    rows = []
    version = args.version
    blocks = int(args.bucket_mb * 2**20) // 2 if args.way == "one" else None
    pusher.push(model, version)  # warm-up: connect, allocate
    for _ in range(args.repeats):
        dist.barrier()
        tx0, t0 = _tx(), time.perf_counter()
        # The gathers alone, as the push runs them: one sender brings a
        # parameter over a quarter bucket to rank 0 alone, in row blocks
        # (drained as the iterator moves on); every rank sending gathers each
        # one whole on every rank; own rows gather nothing.
        for _name, _t in iter_full_tensors(model, block_bytes=blocks) \
                if args.way not in ("own", "default") else ():
            pass
        dist.barrier()
        tx1, t1 = _tx(), time.perf_counter()
        version += 1
        result = pusher.push(model, version)
        dist.barrier()
        tx2 = _tx()
        rows.append({"gather_bytes": tx1 - tx0, "gather_s": t1 - t0,
                     "push_bytes": tx2 - tx1 - (tx1 - tx0), "push_s": result.timings["total_s"],
                     "gather_send_s": result.timings["gather_send_s"],
                     "commit_s": result.timings["commit_s"],
                     "senders": result.senders, "reason": result.senders_reason,
                     "own_rows": result.own_rows, "own_rows_reason": result.own_rows_reason,
                     "nbytes": result.nbytes})
    pusher.close()
    everyone = all_gather_object(rows)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def _replica_tx(name: str) -> int:
    """Bytes node `name` has sent: its link's host end received them."""
    return int(Path(f"/sys/class/net/rs-{name}-h/statistics/rx_bytes").read_text())


def run_config(ips: dict[str, str], urls: list[str], ranks: int, way: str,
               version: int, env: dict[str, str], args: argparse.Namespace
               ) -> tuple[list[list[dict]], list[float]]:
    """Every rank's rows, and each replica's upload per push (the warm-up's
    included: every push carries the same bytes)."""
    from netns import exec_prefix

    out = args.workdir / "links-result.json"
    out.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = []
    replicas = REPLICAS[:len(urls)]
    tx0 = [_replica_tx(n) for n in replicas]
    for r in range(ranks):
        cmd = [*exec_prefix(f"t{r}"), sys.executable, __file__, "--worker", "--urls",
               ",".join(urls), "--way", way, "--version", str(version), "--out",
               str(out), "--size", args.size, "--repeats", str(args.repeats), "--bucket-mb",
               str(args.bucket_mb)]
        procs.append(subprocess.Popen(cmd, env=dict(
            os.environ, **env, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK="0",
            MASTER_ADDR=ips["t0"], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0")))
    try:
        for p in procs:
            p.wait(timeout=1800)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    pushes = args.repeats + 1
    return json.loads(out.read_text()), [(_replica_tx(n) - t) / pushes
                                          for n, t in zip(replicas, tx0, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--link", default="1gbit", help="tc rate of each node's upload")
    ap.add_argument("--repeats", type=int, default=2)
    # 8 MiB: the 100m model is 26 buckets, about as many per rank as a large
    # model in the default 256 MiB buckets (a bucket is the unit shared out).
    ap.add_argument("--bucket-mb", type=float, default=8)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--ways", default="one,all,own",
                    help="of one, all (gathered), own, default (the pusher's own choice)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--way", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from netns import nodes

    print(machine(), flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = build_llama(*SIZES[args.size])
    rank_counts = [int(n) for n in args.ranks.split(",")]
    rate = _bits_per_s(args.link) / 8
    env = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "0"}
    replica_counts = [int(n) for n in args.replicas.split(",")]
    names = [f"t{r}" for r in range(max(rank_counts))] + list(REPLICAS[:max(replica_counts)])
    rows, version = [], 0
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        from netns import exec_prefix

        ips = stack.enter_context(nodes(names, args.link))
        servers = [stack.enter_context(serve(
            ckpt, args.workdir / f"links-{n}.log", env={**env, "GLOO_SOCKET_IFNAME": "eth0"},
            prefix=exec_prefix(n), host=ips[n])) for n in REPLICAS[:max(replica_counts)]]
        urls = [s.url for s in servers]
        print(f"{args.size}; each node uploads at {args.link}; {load()}", flush=True)
        for ranks in rank_counts:
            for replicas in replica_counts:
                for way in args.ways.split(","):
                    version += 1000
                    per_rank, replica_tx = run_config(ips, urls[:replicas], ranks, way,
                                                      version, env, args)
                    rows.append(_row(ranks, replicas, way, per_rank, replica_tx, rate))
                    print(f"  {ranks} ranks, {replicas} replica(s), {way}: {rows[-1][3]} s",
                          flush=True)
    if not rows:
        return
    print(f"\nmedian of {args.repeats} pushes, bucket {args.bucket_mb:g} MiB, each node's "
          f"upload {args.link}; {time.perf_counter() - t_start:.0f}s; {load()}")
    print(table(["ranks", "replicas", "sends", "push s", "gather+send s", "commit s",
                 "push MB out of busiest trainer link", "/ (model / N)", "gathers MB per link",
                 "replicas' upload MB", "busiest link", "its wire s", "push s / wire s",
                 "gather+send s / wire s"], rows))


_WAYS = {"one": "rank 0", "all": "all, gathered", "own": "all, own rows", "default": "default"}


def _row(ranks: int, replicas: int, way: str, per_rank: list[list[dict]],
         replica_tx: list[float], rate: float) -> list[object]:
    first = per_rank[0][0]
    model = first["nbytes"]
    if way != "default" and ((way == "own") != first["own_rows"]
                             or (way != "one") != (first["senders"] > 1)):
        raise RuntimeError(f"{way}: went with {first['senders']} senders "
                           f"({first['reason']}), own rows {first['own_rows']} "
                           f"({first['own_rows_reason']})")
    push_s = median([r["push_s"] for r in per_rank[0]])
    push_out = [median([r["push_bytes"] for r in rows]) for rows in per_rank]
    gather_out = [median([r["gather_bytes"] for r in rows]) for rows in per_rank]
    links = {f"trainer {r}": push_out[r] + gather_out[r] for r in range(ranks)}
    links.update({f"replica {i}": b for i, b in enumerate(replica_tx)})
    busiest = max(links, key=lambda k: links[k])
    wire_s = links[busiest] / rate
    send_s = median([r["gather_send_s"] for r in per_rank[0]])
    return [ranks, replicas, _WAYS[way], f"{push_s:.2f}", f"{send_s:.2f}",
            f"{median([r['commit_s'] for r in per_rank[0]]):.2f}",
            f"{max(push_out) / 1e6:.0f}", f"{max(push_out) / (model / ranks):.2f}x",
            "/".join(f"{g / 1e6:.0f}" for g in gather_out),
            "/".join(f"{b / 1e6:.0f}" for b in replica_tx), busiest, f"{wire_s:.2f}",
            f"{push_s / wire_s:.2f}x", f"{send_s / wire_s:.2f}x"]


def _bits_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"link rate like 1gbit, not {rate!r}")


if __name__ == "__main__":
    main()
