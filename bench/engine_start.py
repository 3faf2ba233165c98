"""The engine core spawned (vLLM-CPU's choice) or forked (vLLM's on GPU, and
the test servers'), and the whole server forked from a process that imported
it already (the test servers' zygote, tests/server_zygote.py): a server's
start, a generation batch and its stop, side by side, alternating, in one run.

Each round runs one server of the default model (the worker inside the engine
core, as the test servers run it) in a fresh child process of this script,
so the CPU of the whole server (its API process and engine core, both reaped)
is counted: to ready, for the batch, and the rest (the stop). A zygote's
server is its child, not this script's: the zygote reports the CPU it reaped
(`ForkedProcess.cpu_s`); the zygote's own imports, paid once a session, are not
counted.

    .venv/bin/python bench/engine_start.py [--rounds 2] [--batch 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from _common import CACHE, machine, median, table

from rollout_sidecar.server.launcher import DEFAULT_ENV, launch_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' zygote
from tests.server_zygote import ForkedProcess, Zygote  # noqa: E402

METHODS = ("spawn", "fork", "zygote")


def tree_cpu(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def one(method: str, batch: int, max_tokens: int, log: Path) -> dict[str, float]:
    """Start, generate, stop: seconds and CPU-seconds of each."""
    env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(CACHE), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn" if method == "spawn" else "fork",
           "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25"}
    zygote = None
    if method == "zygote":
        zygote = Zygote(log.parent / "engine_start-zygote", {**DEFAULT_ENV, **os.environ, **env})
        assert zygote.ready(), zygote.log.read_text()
    t0 = time.monotonic()
    server = launch_server(log=log, max_model_len=512, dtype="float32", env=env,
                           args=["--log-level", "warning"],
                           popen=zygote.popen if zygote else subprocess.Popen)
    ready_s, ready_cpu = time.monotonic() - t0, tree_cpu(server.proc.pid)
    t1 = time.monotonic()
    body = {"prompts": ["hello world"] * batch,
            "sampling": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 1}}
    with server.stopped_on_error(), httpx.Client(timeout=300) as c:
        r = c.post(server.url + "/generate", json=body,
                   headers={"Authorization": f"Bearer {server.api_token}"})
        r.raise_for_status()
    gen_s, gen_cpu = time.monotonic() - t1, tree_cpu(server.proc.pid) - ready_cpu
    t2 = time.monotonic()
    server.stop()
    stop_s = time.monotonic() - t2
    if zygote is not None:
        assert isinstance(server.proc, ForkedProcess), zygote.log.read_text()
        total = server.proc.cpu_s
        zygote.close()
    else:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = ru.ru_utime + ru.ru_stime
    return {"ready_s": ready_s, "ready_cpu": ready_cpu, "gen_s": gen_s, "gen_cpu": gen_cpu,
            "stop_s": stop_s, "stop_cpu": total - ready_cpu - gen_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        log = Path(f"/tmp/engine_start-{args.one}.log")
        print(json.dumps(one(args.one, args.batch, args.max_tokens, log)))
        return
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            out = subprocess.run([sys.executable, __file__, "--one", method, "--batch",
                                  str(args.batch), "--max-tokens", str(args.max_tokens)],
                                 capture_output=True, text=True, timeout=900, check=True)
            runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = ("ready_s", "ready_cpu", "gen_s", "gen_cpu", "stop_s", "stop_cpu")
    med = {m: {k: median([r[k] for r in runs[m]]) for k in keys} for m in METHODS}
    rows = [[m, *(f"{med[m][k]:.2f}" for k in keys)] for m in METHODS]
    rows.append(["fork / spawn", *(f"{med['fork'][k] / med['spawn'][k]:.2f}" for k in keys)])
    rows.append(["zygote / fork", *(f"{med['zygote'][k] / med['fork'][k]:.2f}" for k in keys)])
    print(machine())
    print(f"median of {args.rounds} rounds; batch {args.batch} x {args.max_tokens} tokens")
    print(table(["engine core", *keys], rows))


if __name__ == "__main__":
    main()
