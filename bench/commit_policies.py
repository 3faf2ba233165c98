"""Commit policies side by side: wait, abort and keep, one server, one load.

One fp32 server (the default model). For each policy in turn, `--clients`
clients send long requests (n = 2, 96 tokens, no early stop) in a loop while
a trainer pushes `--pushes` versions, one every `--every` seconds (version k:
the checkpoint plus noise seeded by k). Per policy:

- wasted/commit: tokens of samples that ended "abort" (a loop throws them
  away), per commit;
- commit s: the server's commit time (gate shut to gate open: drain, pause,
  load, resume), median and max;
- tok/s: tokens of finished samples (stop or length) per second of the run;
- max err: the largest mean |dlogp| of a sample against a transformers replay
  under its spans (tests/reliability/token_replay.py; fp32, so ~1e-7 when the
  spans are right).

    .venv/bin/python bench/commit_policies.py [--clients 8] [--pushes 8] [--every 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _common import load, machine, serve, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' oracle
from tests.reliability.oracle import VersionedWeights  # noqa: E402
from tests.reliability.token_replay import TokenReplay, spans_from_json  # noqa: E402

POLICIES = ["wait", "abort", "keep"]  # resume is keep by its other name


@dataclass
class Run:
    policy: str
    samples: list[dict] = field(default_factory=list)  # finished or aborted
    commit_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


async def client(url: str, token: str, seed: int, stop: threading.Event, run: Run) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            prompt = [rng.randrange(256) for _ in range(rng.randint(4, 12))]
            r = await c.post("/generate", json={"prompt_token_ids": [prompt], "sampling": {
                "n": 2, "max_tokens": 96, "temperature": 1.0, "seed": rng.randrange(1 << 30)}})
            if r.status_code != 200:
                run.errors.append(f"{r.status_code} {r.text[:200]}")
                continue
            for s in r.json()["results"][0]["samples"]:
                run.samples.append({"prompt": prompt, **s})


def run_policy(server, pusher, weights: VersionedWeights, policy: str, first: int,
               args: argparse.Namespace) -> Run:
    run = Run(policy)
    stop = threading.Event()
    pusher.commit_policy = policy

    def train() -> None:
        try:
            time.sleep(args.every)
            for v in range(first, first + args.pushes):
                res = pusher.push(weights.load(v), version=v, probe=False)
                run.commit_s.append(res.timings["server_commit_s"])
                time.sleep(args.every)
        except Exception as e:  # noqa: BLE001 - reported in the table
            run.errors.append(f"push: {e}")
        finally:
            stop.set()

    async def rollouts() -> None:
        await asyncio.gather(*[client(server.url, server.api_token, 100 * first + i, stop, run)
                               for i in range(args.clients)])

    t0 = time.monotonic()
    trainer = threading.Thread(target=train)
    trainer.start()
    asyncio.run(rollouts())
    trainer.join()
    run.seconds = time.monotonic() - t0
    return run


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pushes", type=int, default=8)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between pushes")
    args = ap.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp, serve(None, Path(tmp) / "server.log",
                                                      env={"ROLLOUT_SIDECAR_DTYPE": "float32"}
                                                      ) as server:
        path = httpx.get(server.url + "/info", timeout=30, headers={
            "Authorization": f"Bearer {server.api_token}"}).json()["model"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        weights = VersionedWeights(model)
        replay = TokenReplay(VersionedWeights(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()))
        pusher = WeightPusher(server.url, admin_token=server.admin_token, bucket_mb=1)
        rows, first = [], 1
        for policy in POLICIES:
            run = run_policy(server, pusher, weights, policy, first, args)
            first += args.pushes
            done = [s for s in run.samples if s["finish_reason"] != "abort"]
            wasted = sum(len(s["token_ids"]) for s in run.samples if s["finish_reason"] == "abort")
            errs = [replay.gap(s["prompt"], s["token_ids"], s["logprobs"],
                               spans_from_json(s["weight_versions"]))
                    for s in run.samples if s["token_ids"] and s["weight_versions"]]
            rows.append([policy, len(run.commit_s), wasted / max(len(run.commit_s), 1),
                         statistics.median(run.commit_s) if run.commit_s else float("nan"),
                         max(run.commit_s, default=float("nan")),
                         sum(len(s["token_ids"]) for s in done) / run.seconds,
                         max(errs, default=0.0), len(run.errors)])
            print(f"{policy}: {len(run.samples)} samples, {run.seconds:.1f} s, {load()}",
                  *run.errors[:2], flush=True)
        pusher.close()
    print(table(["policy", "commits", "wasted/commit", "commit s (median)", "commit s (max)",
                 "tok/s", "max err", "errors"], rows))


if __name__ == "__main__":
    main()
