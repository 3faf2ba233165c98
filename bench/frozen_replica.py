"""A frozen replica, with rollout threads that each hold their own client.

Two real replicas (one core each), and `--threads` threads each with its OWN
`GenerationClient` over both URLs, default settings, calling
generate(max_tokens=8) in a loop. After `--warm-s` of traffic, replica B's
server and engine processes are SIGSTOPped; requests completed per 10 s are
printed for `--after-s`, then B is SIGCONTed and `--thaw-s` more show it
serving again (its own count of answered /generate, from /metrics).

Issue 26 item 3 measured [6, 0, 0, 868, 2094] and [8, 0, 0, 0, 0, 0] per 10 s
after the freeze with per-thread clients: each found the frozen replica out
alone, after `stall_timeout_s` (30 s). The process-wide liveness probe
(protocol/calls/liveness.py) should leave it within 10 s for every client.

    flock /tmp/heavy.lock timeout 900 .venv/bin/python bench/frozen_replica.py \\
        [--threads 4] [--after-s 60] [--no-liveness]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import CACHE, ENGINE_ENV, default_model, launch_server, machine, table

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.server.launcher import ServerProcess, process_tree

WINDOW_S = 10.0


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def served(server: ServerProcess, route: str) -> int:
    """The server's own count of `route` requests it answered 200 (/metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = rf'rollout_sidecar_requests_total{{[^}}]*route="{re.escape(route)}"[^}}]*' \
              rf'status="200"[^}}]*}} ([0-9.e+]+)'
    return int(sum(float(m) for m in re.findall(pattern, text)))


class Rollouts:
    """`n` threads, each with its own client; every completion's time is kept."""

    def __init__(self, urls: list[str], token: str, n: int, liveness: bool) -> None:
        kw = {} if liveness else {"liveness": None}
        self.clients = [GenerationClient(urls, api_token=token, **kw) for _ in range(n)]
        self.done: list[float] = []
        self.latency: list[tuple[float, float]] = []  # (end, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c, i), daemon=True)
                         for i, c in enumerate(self.clients)]

    def _run(self, client: GenerationClient, i: int) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                client.generate([f"frozen replica bench {i}"], sampling=dict(max_tokens=8))
            except Exception as e:  # reported
                self.errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            end = time.monotonic()
            self.done.append(end)
            self.latency.append((end, end - t0))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(330)
        for c in self.clients:
            c.close()

    def count(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.done) if start <= t < end)

    def frozen(self, replica: int) -> int:
        """How many clients see `replica` frozen now."""
        return sum(c.replicas()[replica].frozen for c in self.clients)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--warm-s", type=float, default=20.0)
    ap.add_argument("--after-s", type=float, default=60.0)
    ap.add_argument("--thaw-s", type=float, default=20.0)
    ap.add_argument("--no-liveness", action="store_true",
                    help="clients without the shared liveness probe (the old behaviour)")
    args = ap.parse_args()

    model = default_model()
    token = secrets.token_hex(8)
    logs = Path(tempfile.mkdtemp(prefix="frozen-replica-"))
    env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(CACHE), **ENGINE_ENV}
    servers = [launch_server(log=logs / f"{name}.log", model=model, max_model_len=512,
                             cpus=cpu, own_session=True, wait=False, api_token=token,
                             args=["--log-level", "warning"], env=env)
               for name, cpu in (("a", "0"), ("b", "1"))]
    frozen_pids: list[int] = []
    try:
        for s in servers:
            s.wait_ready(600)
        a, b = servers
        print(machine())
        rollouts = Rollouts([a.url, b.url], token, args.threads, not args.no_liveness)
        rollouts.start()
        time.sleep(args.warm_s)
        health_before = [served(s, "/health") for s in servers]

        frozen_pids = process_tree(b.proc.pid)
        signal_all(frozen_pids, signal.SIGSTOP)
        t0 = time.monotonic()
        first_seen = all_seen = None
        while time.monotonic() < t0 + args.after_s:
            seen = rollouts.frozen(1)
            now = time.monotonic() - t0
            if seen and first_seen is None:
                first_seen = now
            if seen == args.threads and all_seen is None:
                all_seen = now
            time.sleep(0.1)
        signal_all(frozen_pids[::-1], signal.SIGCONT)
        frozen_pids = []
        t1 = time.monotonic()
        b_before = served(b, "/generate")
        time.sleep(args.thaw_s)
        b_after = served(b, "/generate")
        rollouts.stop()
        health = [served(s, "/health") - h for s, h in zip(servers, health_before, strict=True)]

        rows = []
        for k in range(-int(args.warm_s // WINDOW_S), int(args.after_s // WINDOW_S)):
            start = t0 + k * WINDOW_S
            slow = [s for e, s in rollouts.latency if start <= e < start + WINDOW_S]
            rows.append([f"{k * WINDOW_S:+.0f}..{(k + 1) * WINDOW_S:+.0f}",
                         rollouts.count(start, start + WINDOW_S), max(slow, default=0.0)])
        print(f"\n{args.threads} threads, each with its own GenerationClient over A and B "
              f"(liveness {'off' if args.no_liveness else 'default'}); B frozen at 0 s")
        print(table(["s after freeze", "requests", "slowest s"], rows))
        thaw_n = rollouts.count(t1, t1 + args.thaw_s)
        print(f"\nper 10 s after the freeze: "
              f"{[r[1] for r in rows if not r[0].startswith('-')]}")
        print(f"B seen frozen by the first client at {first_seen} s, by all "
              f"{args.threads} at {all_seen} s")
        print(f"after the thaw ({args.thaw_s:g} s): {thaw_n} requests, B answered "
              f"{b_after - b_before} /generate; GET /health answered meanwhile "
              f"(from the freeze on): A {health[0]}, B {health[1]}")
        print(f"errors: {len(rollouts.errors)}" + "".join(f"\n  {e}" for e in
                                                         rollouts.errors[:5]))
    finally:
        signal_all(frozen_pids, signal.SIGCONT)
        for s in servers:
            s.stop(timeout_s=30)


if __name__ == "__main__":
    main()
