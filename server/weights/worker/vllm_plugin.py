"""vLLM general plugin, loaded by vLLM in every process it starts (the engine
core and its workers, and Ray's worker actors: `WorkerWrapperBase.init_worker`
loads general plugins before it resolves the worker class) before the model
loads. It

- registers our weight-transfer backend (registering in the API process alone
  is not enough);
- adds one worker method, `rollout_sidecar_call`, through which every op of
  ops.py travels (worker_calls.py), in every process but the one that hosts
  the engine (the API server, or a headless node's executor; it says so in
  `ENGINE_HOST_PID_ENV`). It used to be added only in multiprocessing
  children, which a Ray actor is not: under Ray every weight op failed. A
  process forked from the engine's host (vLLM forks its engine core on GPU)
  never loads plugins again, so the host arms a fork hook that does it;
- asks the kernel to kill vLLM's child processes when their parent dies, so a
  SIGKILLed server leaves no orphaned EngineCore holding memory and ports.
- on CPU, makes the engine core and workers nap while they wait for work,
  not loop on sched_yield (engine/idle_wait.py);
- lets our server's engine core and workers exit without collecting the
  heap they froze at start-up (engine/exit_heap.py);
- on CPU, keeps a seeded request whose prefill is split from killing the
  engine (engine/seeded_prefill.py).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

BACKEND = "rollout_sidecar"
_PR_SET_PDEATHSIG = 1
_FORK_ARMED = False  # the engine host's fork hook, armed once per process
log = logging.getLogger(__name__)


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # Plugins may be loaded more than once per process.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollout_sidecar.server.weights.worker.transfer_engine",
            "StagedWeightTransferEngine")
    parent = multiprocessing.parent_process()
    if parent is not None:
        _die_with_parent(parent.pid)
    if hosts_engine():
        # vLLM forks the engine core where it can (its default on GPU): the
        # child inherits vLLM's "plugins loaded" flag and never calls us, so
        # it is set up as a worker here, at the fork.
        global _FORK_ARMED
        if not _FORK_ARMED:
            os.register_at_fork(after_in_child=_forked_from_engine_host)
            _FORK_ARMED = True
        return  # it owns its lifetime, and runs no worker
    _as_worker()


def _forked_from_engine_host() -> None:
    _die_with_parent(os.getppid())
    _as_worker()


def _as_worker() -> None:
    _add_worker_method()
    # Before the executor builds its message queues (engine/idle_wait.py).
    from rollout_sidecar.server.engine.idle_wait import wait_idle_on_cpu

    wait_idle_on_cpu()
    from rollout_sidecar.server.engine.exit_heap import keep_heap_frozen_at_exit

    keep_heap_frozen_at_exit()
    from rollout_sidecar.server.engine.seeded_prefill import skip_cpu_generator_rewind

    skip_cpu_generator_rewind()


def hosts_engine() -> bool:
    """Whether this process hosts the engine (module docstring). Without our
    variable (vLLM started by someone else), a process that no
    multiprocessing parent started and that is not a Ray worker."""
    from rollout_sidecar.server.engine.engine_config import ENGINE_HOST_PID_ENV

    host = os.environ.get(ENGINE_HOST_PID_ENV)
    if host is not None:
        return host == str(os.getpid())
    return multiprocessing.parent_process() is None and not _in_ray_worker()


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    # Imported is not initialised: vLLM imports Ray wherever it is installed
    # (v1/engine/async_llm.py), and ray.get_runtime_context() on an
    # uninitialised Ray starts a local Ray instance (ray's auto_init_hook):
    # seconds and a cluster of processes, in any vLLM process on the machine.
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - not initialised: not an actor
        return False


def _die_with_parent(parent_pid: int | None) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was armed


def _add_worker_method() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from rollout_sidecar.server.weights.ops import WORKER_METHOD

    def rollout_sidecar_call(self: Worker, op: str, payload: dict | None = None) -> dict:
        # Answers with a value, never a raise: see worker_calls.py.
        from rollout_sidecar.server.weights.worker.worker_calls import run_call

        return run_call(self, op, payload or {})

    if not hasattr(Worker, WORKER_METHOD):
        setattr(Worker, WORKER_METHOD, rollout_sidecar_call)
    from rollout_sidecar.server.weights.worker.adapter_loading import patch_vllm_lora

    patch_vllm_lora()
