"""Our engine's processes exit without collecting their start-up heap.

vLLM tears an engine core down as if the engine were deleted inside a
process that lives on: `EngineCore.shutdown` (v1/engine/core.py: "Undo the
gc.freeze() from __init__ so that the objects allocated during engine
startup ... become visible to the garbage collector again. Without this,
deleting the engine in-process (e.g. unit tests) leaks GPU memory"),
`Worker.shutdown` (v1/worker/gpu_worker.py) and
`cleanup_dist_env_and_memory` (distributed/parallel_state.py) each call
`gc.unfreeze()`, then `GPUModelRunner._cleanup_profiling_kv_cache` and
`cleanup_dist_env_and_memory` each run `gc.collect()` over the whole heap.
A full collection walks every object the process holds (vLLM, torch,
transformers), and in a forked engine core it writes to every page it
shares with its parent. It is most of a server's stop (bench/engine_start.py,
stop CPU-s).

Our server's engine core and workers are processes of their own, which exit
right after (multiprocessing's `os._exit`): the exit frees the start-up heap
whole. So in them `gc.unfreeze` keeps the heap frozen: the collections
still reclaim what serving allocated since start-up (staged weights, spent
requests), not what start-up did. vLLM does the same on ROCm after a clean
shutdown (`EngineCoreProc.run_engine_core`: "Freeze the surviving graph to
skip another slow cyclic-GC scan during finalization; process exit
reclaims it").

Only in the processes of our server (it names its own pid in
`ENGINE_HOST_PID_ENV`, engine_config.py), never in the server itself: a
vLLM that someone else runs with our plugin installed (a Ray actor that
deletes and rebuilds its engine in-process) keeps vLLM's teardown.
"""

from __future__ import annotations

import gc
import os

from rollout_sidecar.server.engine.engine_config import ENGINE_HOST_PID_ENV


def keep_heap_frozen_at_exit() -> None:
    """In an engine process of our server, `gc.unfreeze` does nothing from
    now on (module docstring). Idempotent: plugins load more than once."""
    host = os.environ.get(ENGINE_HOST_PID_ENV)
    if host is None or host == str(os.getpid()):
        return
    gc.unfreeze = _keep_frozen


def _keep_frozen() -> None:
    """`gc.unfreeze` in an engine process of our server, which exits next."""
