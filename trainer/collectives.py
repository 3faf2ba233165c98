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
    """Where the trainer group's collectives run: the host where its backend
    takes CPU tensors (gloo: "cpu:gloo,cuda:gloo"), else the current GPU (NCCL:
    "cuda:nccl"). Asked of torch's own map, not by the backend's name."""
    if "cpu:" in dist.get_backend_config():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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


def gather_bytes(payload: torch.Tensor, dst: int | None = None) -> list[torch.Tensor]:
    """Every rank's `payload` (uint8, any length), in rank order, on the host:
    on every rank (`dst` None) or on `dst` alone (the others get []). Each
    rank's length goes first, then the payloads padded to the longest, every
    collective `settled`."""
    dev, world = device(), dist.get_world_size()
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(world)]
    settled(lambda: dist.all_gather(sizes, size, async_op=True), [*sizes, size])
    counts = [int(s) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=dev)
    padded[: payload.numel()].copy_(payload)
    if dst is not None and dist.get_rank() != dst:
        settled(lambda: dist.gather(padded, None, dst=dst, async_op=True), [padded])
        return []
    bufs = [torch.empty_like(padded) for _ in range(world)]
    if dst is None:
        settled(lambda: dist.all_gather(bufs, padded, async_op=True), [padded, *bufs])
    else:
        settled(lambda: dist.gather(padded, bufs, dst=dst, async_op=True), [padded, *bufs])
    return [b[:n].cpu() for b, n in zip(bufs, counts, strict=True)]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order, on every rank of the
    default group, as `dist.all_gather_object` would, but `settled`. torch's
    own leaves its tensors to the worker threads: a rank that exits soon
    after (a report gathered, a barrier, then return) aborted 4 runs in 40
    on this machine, from a gloo worker's `decref_pyobject` in teardown
    (bench/exit_after_collective.py)."""
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return [pickle.loads(b.numpy().tobytes()) for b in gather_bytes(mine)]
