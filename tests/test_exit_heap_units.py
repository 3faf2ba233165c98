"""Units for server/engine/exit_heap.py, each in a fresh spawned interpreter
(the patch changes `gc.unfreeze` for the rest of a process's life): an
engine process of our server keeps its frozen heap frozen at exit; the
server itself, and a vLLM process someone else runs, keep vLLM's teardown."""

from __future__ import annotations

import multiprocessing
import os

from tests.processes import in_spawned_process

HOST_PID_ENV = "ROLLOUT_SIDECAR_ENGINE_HOST_PID"


def _unfreeze_after_the_patch(host: str | None, out: multiprocessing.Queue) -> None:
    import gc

    os.environ.pop(HOST_PID_ENV, None)
    if host is not None:
        os.environ[HOST_PID_ENV] = str(os.getpid()) if host == "this process" else host
    from rollout_sidecar.server.engine.exit_heap import keep_heap_frozen_at_exit

    keep_heap_frozen_at_exit()
    keep_heap_frozen_at_exit()  # plugins load more than once per process
    gc.freeze()
    frozen = gc.get_freeze_count()
    gc.unfreeze()  # what vLLM's teardown calls
    out.put((frozen > 0, gc.get_freeze_count()))


def frozen_after_unfreeze(host: str | None) -> bool:
    had_frozen, left = in_spawned_process(_unfreeze_after_the_patch, (host,), timeout_s=60)
    assert had_frozen
    return left > 0


def test_an_engine_process_of_our_server_exits_with_its_start_up_heap_frozen():
    assert frozen_after_unfreeze("1")  # the engine core or a worker: its host is another pid


def test_the_server_itself_and_anyone_elses_vllm_keep_vllms_teardown():
    assert not frozen_after_unfreeze("this process")  # the API server hosts the engine
    assert not frozen_after_unfreeze(None)  # a vLLM someone else runs, our plugin installed
