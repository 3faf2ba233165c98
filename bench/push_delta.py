"""Delta pushes against dense ones, side by side on the same weights, one run.

A trainer (fp32 master weights, AdamW at `--lr`, random token batches) takes
`--steps` steps; after each it pushes the same weights twice: to replica group
A with `WeightPusher()` (delta="auto", the default) and to group B with
`delta=False`. Each group is `--replicas` real servers serving the checkpoint
in bf16, each pinned to one core. The first push of each is dense for both
(nothing to diff against) and is left out. Per lr it prints the changed share
of bf16 elements per step, bytes on the wire, the diff time, the send and the
whole push (commit and probe included), dense / delta. `--full-diff` adds a
group C pushed with delta="auto" but the early sample switched off (every
push diffs every element first, as before issue 58): a dense step's cost
with and without the sample's early decision, side by side.

Networks: loopback (default), or `--link 2gbit` (trainer and every replica in
their own network namespace, each node's upload capped by tc: netns.py, root).

    .venv/bin/python bench/push_delta.py [--size 100m] [--lrs 1e-6,1e-5]
        [--steps 20] [--replicas 1] [--link 2gbit]
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


@contextlib.contextmanager
def _no_early_sample():
    """delta="auto" as before the early sample: the full diff always runs."""
    from rollout_sidecar.trainer.delta import delta_push

    saved, delta_push.EARLY_DENSE = delta_push.EARLY_DENSE, float("inf")
    try:
        yield
    finally:
        delta_push.EARLY_DENSE = saved


def measure(delta_urls: list[str], dense_urls: list[str], token: str,
            args: argparse.Namespace, full_urls: list[str] | None = None
            ) -> dict[str, list[dict]]:
    """Every lr, in this process (the trainer): one row per push."""
    from rollout_sidecar.trainer import WeightPusher

    torch.set_num_threads(args.threads)
    out: dict[str, list[dict]] = {}
    version = 1
    for lr in args.lrs.split(","):
        model = load_trainer_model(build_llama(*SIZES[args.size]), torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=float(lr))
        g = torch.Generator().manual_seed(0)
        by_delta = WeightPusher(delta_urls, token, bucket_mb=args.bucket_mb)
        by_dense = WeightPusher(dense_urls, token, bucket_mb=args.bucket_mb, delta=False)
        by_full = WeightPusher(full_urls, token, bucket_mb=args.bucket_mb) if full_urls else None
        rows = []
        try:
            for step in range(args.steps + 1):
                if step:  # push 0: the checkpoint, dense for both (the base)
                    batch = torch.randint(0, 256, (args.batch, 64), generator=g)
                    opt.zero_grad()
                    model(input_ids=batch, labels=batch).loss.backward()
                    opt.step()
                a = by_delta.push(model, version=version)
                b = by_dense.push(model, version=version)
                c = None
                if by_full is not None:
                    with _no_early_sample():
                        c = by_full.push(model, version=version)
                version += 1
                if step:
                    rows.append(dict(encoding=a.encoding, why=a.delta_reason,
                                     changed=a.changed, elements=a.elements,
                                     delta=a.nbytes, dense=b.nbytes, delta_t=a.timings,
                                     dense_t=b.timings, probe=[a.probe_gap, b.probe_gap],
                                     full_t=c.timings if c else None,
                                     full_why=c.delta_reason if c else None))
                    print(f"lr {lr} step {step}: {a.encoding} "
                          f"{(a.changed or 0) / (a.elements or 1):.2%} changed, "
                          f"{a.nbytes / 2**20:.1f} / {b.nbytes / 2**20:.1f} MiB, push "
                          f"{a.timings['total_s']:.2f} / {b.timings['total_s']:.2f} s",
                          flush=True)
        finally:
            by_delta.close()
            by_dense.close()
            if by_full is not None:
                by_full.close()
        out[lr] = rows
    return out


def measure_in(prefix: list[str], delta_urls: list[str], dense_urls: list[str], token: str,
               args: argparse.Namespace, full_urls: list[str] | None = None
               ) -> dict[str, list[dict]]:
    """`measure` in a child process run under `prefix` (the trainer's node)."""
    out = args.workdir / "delta-result.json"
    out.unlink(missing_ok=True)
    groups = [delta_urls, dense_urls, *([full_urls] if full_urls else [])]
    cmd = [*prefix, sys.executable, __file__, "--measure",
           ";".join(",".join(g) for g in groups), "--out", str(out),
           "--size", args.size, "--lrs", args.lrs, "--steps", str(args.steps),
           "--bucket-mb", str(args.bucket_mb), "--threads", str(args.threads),
           "--batch", str(args.batch)]
    subprocess.run(cmd, check=True, timeout=7200, env=dict(
        os.environ, ROLLOUT_SIDECAR_ADMIN_TOKEN=token, GLOO_SOCKET_IFNAME="eth0"))
    return json.loads(out.read_text())


# PushResult.timings: diff (delta only), begin (opening and diff included), gather
# and send, a delta's patches into the staged copy (after the check, before the
# commit), the server's commit (drain, pause, load, publish) and its load, then
# the probe (the shard copy's update included).
STEPS = ("diff_s", "begin_s", "gather_send_s", "server_patch_s", "server_commit_s",
         "server_load_s", "probe_s", "total_s")


def report(res: dict[str, list[dict]], args: argparse.Namespace, wall: float) -> None:
    headers = ["lr", "delta pushes", "changed % (min / median / max)", "MiB dense",
               "MiB delta", "bytes ratio", "B / changed elt", "diff s", "send s dense / delta",
               "push s dense / delta", "push ratio"]
    rows = []
    for lr, pushes in res.items():
        deltas = [p for p in pushes if p["encoding"] == "delta"]
        share = [p["changed"] / p["elements"] for p in deltas] or [0.0]
        dense_b = median([p["dense"] for p in pushes])
        delta_b = median([p["delta"] for p in pushes])
        per_elt = median([p["delta"] / p["changed"] for p in deltas if p["changed"]] or [0.0])
        t = {k: (median([p["dense_t"][k] for p in pushes]), median([p["delta_t"][k]
                                                                    for p in pushes]))
             for k in ("gather_send_s", "total_s")}
        diff = median([p["delta_t"].get("diff_s", 0.0) for p in deltas] or [0.0])
        rows.append([lr, f"{len(deltas)}/{len(pushes)}",
                     f"{min(share):.2%} / {median(share):.2%} / {max(share):.2%}",
                     f"{dense_b / 2**20:.1f}", f"{delta_b / 2**20:.2f}",
                     f"{dense_b / delta_b:.1f}x" if delta_b else "no bytes", f"{per_elt:.2f}",
                     f"{diff:.3f}",
                     f"{t['gather_send_s'][0]:.3f} / {t['gather_send_s'][1]:.3f}",
                     f"{t['total_s'][0]:.3f} / {t['total_s'][1]:.3f}",
                     f"{t['total_s'][0] / t['total_s'][1]:.2f}x"])
        for p in pushes:
            if p["encoding"] != "delta":
                print(f"lr {lr}: a dense push: {p['why']}")
    net = f"each node uploads at {args.link}" if args.link else "loopback"
    print(f"\n{args.size}, {args.replicas} replica(s) per group, {net}, bucket "
          f"{args.bucket_mb:g} MiB, medians over {args.steps} steps; {wall:.0f}s; {load()}")
    print(table(headers, rows))
    full = [(lr, pushes) for lr, pushes in res.items() if pushes and pushes[0].get("full_t")]
    if full:
        print("\nThe early sample (delta='auto' with it / without it, the full diff; dense "
              "alone: delta=False):")
        print(table(["lr", "push s auto", "push s full diff", "push s dense", "full diff / auto",
                     "auto / dense"], [[lr, *(f"{t:.3f}" for t in trio),
                                        f"{trio[1] / trio[0]:.2f}x", f"{trio[0] / trio[2]:.2f}x"]
                                       for lr, pushes in full
                                       for trio in [tuple(median([p[k]["total_s"] for p in pushes])
                                                          for k in ("delta_t", "full_t",
                                                                    "dense_t"))]]))
    print("\nWhere a push's time goes (medians, s, dense / delta):")
    print(table(["lr", *STEPS], [[lr, *(
        f"{median([p['dense_t'].get(k, 0.0) for p in pushes]):.3f} / "
        f"{median([p['delta_t'].get(k, 0.0) for p in pushes]):.3f}" for k in STEPS)]
        for lr, pushes in res.items()]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--full-diff", action="store_true",
                    help="a third group: delta='auto' with the early sample off")
    ap.add_argument("--link", help="tc rate of each node's upload, e.g. 2gbit (root only)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:  # the trainer's half, on its own node
        delta_urls, dense_urls, *full = (g.split(",") for g in args.measure.split(";"))
        res = measure(delta_urls, dense_urls, os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"], args,
                      full[0] if full else None)
        Path(args.out).write_text(json.dumps(res))
        return
    print(machine(), flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = build_llama(*SIZES[args.size])
    env = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8),
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "0"}
    groups = "abc" if args.full_diff else "ab"
    names = [f"{g}{i}" for g in groups for i in range(args.replicas)]
    ncores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        if args.link:
            from netns import exec_prefix, nodes

            ips = stack.enter_context(nodes(["t", *names], args.link))
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        servers = {n: stack.enter_context(serve(
            ckpt, args.workdir / f"delta-{n}.log", env=env, cpus=str(i % ncores),
            prefix=exec_prefix(n) if args.link else None, host=ips[n] if args.link else None))
            for i, n in enumerate(names)}
        urls = {g: [servers[n].url for n in names if n[0] == g] for g in groups}
        t0 = time.perf_counter()
        res = measure_in(exec_prefix("t") if args.link else [], urls["a"], urls["b"],
                         env["ROLLOUT_SIDECAR_ADMIN_TOKEN"], args, urls.get("c"))
        (args.workdir / f"delta-{args.size}-{args.link or 'loopback'}-r{args.replicas}.json"
         ).write_text(json.dumps(res))
    report(res, args, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
