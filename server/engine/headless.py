"""`serve --headless`: this host's workers of an engine that spans several
hosts with vLLM's multiprocessing executor (nnodes > 1), served by node 0.

What vLLM's own `vllm serve --headless` does for node_rank > 0
(vllm/entrypoints/cli/serve.py, `run_headless`): build the engine's config
and run a `MultiprocExecutor` with its worker monitor inline; node 0's engine
core reaches these workers over its message queues (TCP) and
torch.distributed at master_addr:master_port. Here the config is ours
(engine_config.py), so these workers get our weight-transfer backend, the
same defaults and KV cache as node 0's, and our plugin (every op a push
needs is answered here too). Nothing else runs: no HTTP, no tokenizer.

Exits, with the executor shut down, on SIGTERM/SIGINT, when one of its
workers dies (exit code 1), or when node 0 is gone: its workers would wait on
it forever (their message queues never hear of it), so a thread here checks
node 0's torch.distributed store at master_addr:master_port, which lives as
long as node 0's engine, and ends this host's part once it has been
unreachable for `head_gone_s` (a setting; exit code 0: the engine ended).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import engine_config
from rollout_sidecar.server.engine.drafter import draft_index
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.model.model_source import resolve_model

log = logging.getLogger(__name__)
HEAD_POLL_S = 2.0


class HeadlessRefused(ValueError):
    """The settings do not describe a host of a multi-host engine."""


def check(settings: ServerSettings) -> None:
    if settings.nnodes < 2 or settings.node_rank < 1:
        raise HeadlessRefused(
            f"--headless runs the workers of hosts 1 .. nnodes-1 of one engine: it needs "
            f"nnodes > 1 and node_rank > 0 (got nnodes {settings.nnodes}, node_rank "
            f"{settings.node_rank}); node 0 runs `serve` without --headless")
    if settings.node_rank >= settings.nnodes:
        raise HeadlessRefused(f"node_rank {settings.node_rank} is not below nnodes "
                              f"{settings.nnodes}")


def run_headless(settings: ServerSettings) -> int:
    """Run this host's workers until they exit; the exit code."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    check(settings)
    path = resolve_model(settings)
    index = CheckpointIndex.from_checkpoint(path).with_draft(draft_index(settings.speculative))
    config = engine_config.build(settings, path, index, headless=True)
    pc = config.vllm_config.parallel_config
    log.info("headless node %d of %d: workers of the engine at %s:%d; %s", pc.node_rank,
             pc.nnodes, pc.master_addr, pc.master_port, config.why)
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    executor = MultiprocExecutor(config.vllm_config, monitor_workers=False)
    watch = threading.Thread(target=watch_head, args=(pc.master_addr, pc.master_port,
                                                      settings.head_gone_s),
                             daemon=True, name="rollout-sidecar-head-watch")
    watch.start()
    try:
        executor.start_worker_monitor(inline=True)  # returns once a worker exits
    finally:
        executor.shutdown()
    return 0 if stopping else 1


def watch_head(host: str, port: int, gone_s: float) -> None:
    """SIGTERM this process once node 0's store has not answered for `gone_s`
    (module docstring)."""
    last_seen = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=HEAD_POLL_S):
                last_seen = time.monotonic()
        except OSError:
            if time.monotonic() - last_seen > gone_s:
                log.warning("node 0 (%s:%d) has not answered for %.0fs: this host's workers "
                            "stop", host, port, gone_s)
                os.kill(os.getpid(), signal.SIGTERM)
                return
        time.sleep(HEAD_POLL_S)
