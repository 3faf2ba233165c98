"""Collectives on the trainer's own process group that leave nothing behind
in gloo's worker threads, so a rank can return and exit right after a push.

Why (issue 26): gloo runs each collective on a worker thread, which marks the
work done (our `wait()` returns) and only then drops its references to the
work's tensors. A tensor Python also holds keeps its PyObject alive from C++
while another C++ reference exists, so whichever thread drops that last
other reference releases the PyObject, and that needs the GIL. A rank that
returns a few milliseconds after a push (destroy_process_group() is no help:
gloo's shutdown is a no-op, and FSDP keeps the group alive) can reach
interpreter finalization, holding the GIL throughout, while the worker still
waits for it; CPython then ends the worker with pthread_exit inside the work's
destructor, and the C++ runtime aborts the process: SIGABRT, "terminate
called without an active exception", exit code -6 under torchrun.

So after each collective `settled` waits, with the GIL released, until no
other thread holds any of its tensors: each one's C++ use count and its
PyObject's reference count are back to what they were before the collective.
On CPU tensors (gloo) only: NCCL's watchdog keeps finished work for a while,
and `destroy_process_group()` joins it.
"""

from __future__ import annotations

import logging
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

# A worker lets go microseconds after `wait()` returns, once it has the GIL;
# this bound only keeps a bug from hanging a push.
RELEASE_WAIT_S = 5.0
_POLL_S = 0.0002


def device() -> torch.device:
    """Where the trainer group's collectives run: the current GPU under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _holds(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's C++ use count (where torch tells it) and its PyObject's
    reference count (which C++ raises while it shares the tensor)."""
    return [(t._use_count() if hasattr(t, "_use_count") else 0, sys.getrefcount(t))
            for t in tensors]


def settled(start: Callable[[], Any], tensors: Sequence[torch.Tensor],
            timeout_s: float = RELEASE_WAIT_S) -> None:
    """Run `start()` (a collective over `tensors`, `async_op=True`), wait for
    it, then until gloo's worker thread has let go of every CPU tensor."""
    host = [t for t in tensors if t.device.type == "cpu"]
    before = _holds(host)
    work = start()
    work.wait()
    del work  # our handle on the work, and through it on the tensors
    deadline = time.monotonic() + timeout_s
    while any(now[0] > was[0] or now[1] > was[1]
              for now, was in zip(_holds(host), before, strict=True)):
        if time.monotonic() > deadline:
            log.warning("a gloo worker still holds a collective's tensors %.0f s after it "
                        "finished; an exit right now could abort", timeout_s)
            return
        time.sleep(_POLL_S)  # releases the GIL: the worker may need it to let go


def broadcast_object(obj: T, src: int = 0) -> T:
    """`src`'s `obj` (pickled) on every rank of the default group, as
    `dist.broadcast_object_list` would, but `settled`: its tensors are ours."""
    dev = device()
    sender = dist.get_rank() == src
    data = pickle.dumps(obj) if sender else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    settled(lambda: dist.broadcast(size, src, async_op=True), [size])
    if sender:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev, copy=True)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    settled(lambda: dist.broadcast(payload, src, async_op=True), [payload])
    if sender:
        return obj
    return pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order, on every rank of the
    default group, as `dist.all_gather_object` would, but `settled`. torch's
    own leaves its tensors to the worker threads: a rank that exits soon
    after (a report gathered, a barrier, then return) aborted 2 runs in 30
    on this machine, from a gloo worker's `decref_pyobject` in teardown."""
    dev = device()
    world = dist.get_world_size()
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    settled(lambda: dist.all_gather(sizes, size, async_op=True), [size, *sizes])
    counts = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(counts), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(dev)
    outs = [torch.empty_like(mine) for _ in range(world)]
    settled(lambda: dist.all_gather(outs, mine, async_op=True), [mine, *outs])
    return [pickle.loads(o[:n].cpu().numpy().tobytes())
            for o, n in zip(outs, counts, strict=True)]
