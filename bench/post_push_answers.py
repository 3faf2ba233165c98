"""The same prompt-logprobs request right after a push: when do its answers settle?

Reported (issue 26): a bf16 server asked the same score request twice in the
seconds after a delta push answered 1.9e-3 apart, and was bit-stable five
seconds later. This bench asks whether anything still runs after `push()`
returns, and what else moves an answer:

1. after each push (by delta, the default, and with `--dense` dense), the same
   score request every `--every` s for `--for` s, each answer compared bit for
   bit with the last one; the server is otherwise idle;
2. then the same request alone, while sampled rollouts decode on the server,
   and as 8 copies in one request: what the answer depends on besides the
   weights.

A trainer with fp32 master weights takes an AdamW step before each push, so a
delta carries real changes. The pusher's probe is off; instead each answer's
mean |dlogp| against the trainer's own fp32 forward is printed (the probe's
measure, on the first and the last answer).

    .venv/bin/python bench/post_push_answers.py [--size 100m] [--pushes 3] [--dense]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import build_llama, default_model, load, machine, serve, table
from push import SIZES, load_trainer_model

PROMPT = list(range(3, 250, 4))  # 62 tokens, as the probe's 64
SCORE = dict(max_tokens=1, logprobs=False, prompt_logprobs=True)


def score(client: Any, copies: int = 1) -> list[torch.Tensor]:
    r = client.generate(prompt_token_ids=[PROMPT] * copies, sampling=SCORE)
    return [torch.tensor(x.prompt_logprobs[1:], dtype=torch.float64) for x in r.results]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def trainer_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def poll(client: Any, every_s: float, for_s: float) -> list[tuple[float, torch.Tensor]]:
    """(seconds since the push returned, answer), from right after it."""
    t0, seen = time.monotonic(), []
    while time.monotonic() - t0 < for_s:
        seen.append((time.monotonic() - t0, score(client)[0]))
        time.sleep(every_s)
    return seen


def batched(client: Any) -> dict[str, float]:
    """How far the same request's answer moves with what it shares a batch with."""
    alone = score(client)[0]
    rollouts = threading.Thread(target=lambda: client.generate(
        prompt_token_ids=[[5, 6, 7, 8 + i] for i in range(8)],
        sampling=dict(max_tokens=64, temperature=1.0, seed=1)))
    rollouts.start()
    time.sleep(0.3)  # the rollouts are decoding
    busy = [score(client)[0] for _ in range(3)]
    rollouts.join()
    copies = score(client, 8)
    return {"alone, again": gap(score(client)[0], alone),
            "while 8 rollouts decode": max(gap(x, alone) for x in busy),
            "8 copies in one request": max(gap(x, alone) for x in copies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=["default", *SIZES])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="push with delta=False")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of the server")
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--for", dest="for_s", type=float, default=8.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(machine(), flush=True)
    from rollout_sidecar.trainer import WeightPusher

    ckpt = default_model() if args.size == "default" else build_llama(*SIZES[args.size])
    rows, batch_rows = [], []
    env = {"ROLLOUT_SIDECAR_DTYPE": "bfloat16",
           "ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": str(args.tp)}
    if args.tp > 1:  # one OpenMP thread per worker, on cores of their own where there are
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)])
                                                    for i in range(args.tp))
    # TP > 1 servers start in our session (bench/_common.py's serve says why).
    with tempfile.TemporaryDirectory(prefix="bench-answers-") as tmp, \
            serve(ckpt, Path(tmp) / "server.log", env=env, own_session=args.tp == 1) as server:
        client = server.client()
        model = load_trainer_model(ckpt, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(0)
        pusher = WeightPusher(server.url, admin_token=server.admin_token, bucket_mb=64,
                              delta=False if args.dense else "auto", probe=False)
        version = server.weight_version()
        try:
            for _ in range(args.pushes + 1):
                tokens = torch.randint(0, 256, (2, 64), generator=g)
                opt.zero_grad()
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
                version += 1
                r = pusher.push(model, version=version)
                seen = poll(client, args.every, args.for_s)
                last = seen[-1][1]
                own = trainer_logprobs(model)
                to_trainer = [float((x - own).abs().mean()) for x in (seen[0][1], last)]
                moved = [(t, gap(x, last)) for t, x in seen if gap(x, last) > 0]
                rows.append([version, r.encoding, f"{r.nbytes / 2**20:.2f}",
                             f"{seen[0][0] * 1e3:.0f}", len(seen), len(moved),
                             f"{max((d for _, d in moved), default=0.0):.3g}",
                             f"{moved[-1][0]:.2f}" if moved else "-",
                             " / ".join(f"{x:.3g}" for x in to_trainer)])
                batch_rows.append([version, *(f"{v:.3g}" for v in batched(client).values())])
                print(f"push {version}: {rows[-1]}; batched {batch_rows[-1]}", flush=True)
        finally:
            pusher.close()
    print(f"\n== {ckpt.name}, bf16 server, TP {args.tp}: the same score request every "
          f"{args.every:g} s for {args.for_s:g} s after push() returned; compared with the "
          "last answer ==")
    print(table(["version", "encoding", "MiB", "first answer ms", "answers", "differing",
                 "max |dlogp|", "last differing s", "vs trainer first / last"], rows))
    print("\n== max |dlogp| of the same request against its answer alone, same weights ==")
    print(table(["version", "alone, again", "while 8 rollouts decode",
                 "8 copies in one request"], batch_rows))
    print(load())


if __name__ == "__main__":
    main()
