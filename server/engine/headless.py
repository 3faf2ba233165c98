"""`serve --headless`: this host's workers of an engine that spans several
hosts with vLLM's multiprocessing executor (nnodes > 1), served by node 0.

What vLLM's own `vllm serve --headless` does for node_rank > 0
(vllm/entrypoints/cli/serve.py, `run_headless`): build the engine's config
and run a `MultiprocExecutor`; node 0's engine core reaches these workers
over its message queues (TCP) and torch.distributed at
master_addr:master_port. Here the config is ours (engine_config.py), so these
workers get our weight-transfer backend, the same defaults and KV cache as
node 0's, and our plugin (every op a push needs is answered here too).
Nothing else runs: no HTTP, no tokenizer.

Node 0 is watched, because these workers would not notice it go: their
message queues never hear of it. Its torch.distributed store at
master_addr:master_port lives as long as its engine, and a key this host sets
there on first contact (a prefix of ours: vLLM's keys, counters and waits are
untouched) tells that store from the next one. A poll every HEAD_POLL_S:
 - the key is there: the engine these workers joined;
 - the store answers without the key: node 0 restarted (a pod restart faster
   than `head_gone_s`), and its new engine waits for workers that the old one
   held. This host rejoins: its workers are shut down and a fresh executor of
   the same config joins the new engine, as at the start;
 - no answer for `head_gone_s` (a setting, long enough to ride out a network
   blip): the engine ended; exit code 0, for a supervisor to restart this host.
Also exits, with the executor shut down, on SIGTERM/SIGINT (code 0) and when a
worker dies on its own (code 1). A poll never hangs: a refused connect is a
plain socket's, and torch's client, which can wait forever on a store that
accepts but never answers, runs in a thread waited on for HEAD_TIMEOUT_S.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import socket
import threading
import time
import uuid
from concurrent import futures
from datetime import timedelta
from typing import Any

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import engine_config
from rollout_sidecar.server.engine.drafter import draft_index
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.model.model_source import resolve_model

log = logging.getLogger(__name__)
HEAD_POLL_S = 2.0
HEAD_TIMEOUT_S = 5.0  # one answer of node 0's store
KEY_PREFIX = "rollout_sidecar/headless"


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


class Head(enum.Enum):
    """What a poll of node 0's store says (module docstring)."""

    SAME = "same"  # it answers and holds this host's key
    SILENT = "silent"  # no answer, for less than gone_s so far
    RESTARTED = "restarted"  # it answers without this host's key: a new store
    GONE = "gone"  # no answer for gone_s


class HeadWatch:
    """Node 0's store at host:port, as this host (node_rank) joined it."""

    def __init__(self, host: str, port: int, node_rank: int, gone_s: float,
                 timeout_s: float = HEAD_TIMEOUT_S) -> None:
        self.host, self.port, self.gone_s, self.timeout_s = host, port, gone_s, timeout_s
        self.key = f"{KEY_PREFIX}/{node_rank}/{uuid.uuid4().hex}"
        self.joined = False  # the key is set in the store
        self.last_answer = time.monotonic()
        self._asking: futures.Future[bool] | None = None  # at most one question in flight

    def poll(self) -> Head:
        answer = self._answer()
        now = time.monotonic()
        if answer is None:
            return Head.GONE if now - self.last_answer > self.gone_s else Head.SILENT
        self.last_answer = now
        self.joined = True
        return Head.SAME if answer else Head.RESTARTED

    def _answer(self) -> bool | None:
        """Whether the store holds the key (first contact sets it: True); None
        when it did not answer within timeout_s."""
        if self._asking is None:
            try:  # refused, or unreachable: no torch client (it retries, and logs each try)
                socket.create_connection((self.host, self.port), self.timeout_s).close()
            except OSError:
                return None
            self._asking = futures.Future()
            threading.Thread(target=self._ask, args=(self._asking, not self.joined),
                             daemon=True, name="rollout-sidecar-head-watch").start()
        ask = self._asking
        if not futures.wait([ask], self.timeout_s).done:
            return None  # still waiting on it: the next poll waits again
        self._asking = None
        if (e := ask.exception()) is not None:  # torch's DistError: reset, timed out
            log.debug("node 0's store (%s:%d) did not answer: %s", self.host, self.port, e)
            return None
        return ask.result()

    def _ask(self, out: futures.Future[bool], join: bool) -> None:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.host, self.port, None, False,
                             timedelta(seconds=self.timeout_s), wait_for_workers=False)
            if join:
                store.set(self.key, f"{socket.gethostname()} pid {os.getpid()}")
            out.set_result(True if join else bool(store.check([self.key])))
        except Exception as e:  # handed to the poll
            out.set_exception(e)


def run_headless(settings: ServerSettings, poll_s: float = HEAD_POLL_S) -> int:
    """Run this host's workers until they exit or node 0 is gone; the exit code."""
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
    rejoins = 0
    while True:
        executor = MultiprocExecutor(config.vllm_config)  # its monitor thread calls back
        try:
            verdict = _watch(executor, HeadWatch(pc.master_addr, pc.master_port, pc.node_rank,
                                                 settings.head_gone_s), poll_s)
        finally:
            executor.shutdown()
        if verdict is not Head.RESTARTED:
            return 0 if verdict is Head.GONE else 1
        rejoins += 1
        log.warning("this host's workers rejoin node 0's new engine (rejoin %d)", rejoins)


def _watch(executor: Any, head: HeadWatch, poll_s: float) -> Head | None:
    """Until a worker dies (None: vLLM's monitor logged which), node 0
    restarted or is gone."""
    worker_died = threading.Event()
    executor.register_failure_callback(worker_died.set)
    log.info("this host's workers joined the engine of node 0 (%s:%d)", head.host, head.port)
    last = Head.SAME
    while not worker_died.wait(poll_s):
        verdict = head.poll()
        if verdict is Head.GONE:
            log.warning("node 0 has not answered for %.0fs: this host's workers stop",
                        head.gone_s)
            return verdict
        if verdict is Head.RESTARTED:
            log.warning("node 0 restarted: its store answers without this host's key")
            return verdict
        if verdict is not last:
            log.warning("node 0 (%s:%d) %s", head.host, head.port,
                        "answers again" if verdict is Head.SAME else
                        f"does not answer: this host's workers wait {head.gone_s:.0f}s for it")
        last = verdict
    return None
