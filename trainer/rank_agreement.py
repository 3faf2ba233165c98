"""Every trainer rank raises the same error at the same point of a push.

Only rank 0 talks to the servers; the other ranks would otherwise carry on
into the next collective (an FSDP gather, the probe's forward) while rank 0
raised, and block there until the process group's timeout. So each step that
rank 0 runs alone goes through `agree`: its result, or its error as a
`(kind, message)` pair (errors.py), is broadcast, and every rank returns the
same value or raises the same exception type. Outside torch.distributed, or
with one rank, these are plain calls. The collectives are `settled`
(collectives.py): a rank may exit right after a push.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rollout_sidecar.trainer.collectives import (
    all_gather_object,
    broadcast_object,
    device,
    settled,
)
from rollout_sidecar.trainer.errors import WeightPushError, from_kind, kind_of

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _single() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def agree(step: Callable[[], T | None]) -> T:
    """Run `step` (rank 0 does the work, the others return None), share its
    result or its error, and raise the same exception type on every rank.

    Anything other than a `WeightPushError` that rank 0 hits (an OOM, a bug, a
    lost connection) is raised everywhere as a `WeightPushError` naming it:
    the other ranks cannot rebuild an arbitrary exception, and the caller
    handles one family.
    """
    try:
        out: Any = ("ok", step())
    except WeightPushError as e:
        out = ("error", (kind_of(e), str(e), e.live))
    except Exception as e:
        out = ("error", ("push", f"{type(e).__name__}: {e}"))
    status, value = broadcast(out)
    if status == "error":
        raise from_kind(*value)
    return value


def broadcast(obj: T) -> T:
    """Rank 0's `obj` on every rank (pickled: keep it small)."""
    if _single():
        return obj
    return broadcast_object(obj, src=0)


def all_ranks(obj: T) -> list[T]:
    """Every rank's `obj` (pickled: keep it small), in rank order, on every rank."""
    if _single():
        return [obj]
    return all_gather_object(obj)


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any: for checks each rank makes
    on its own shard (a meta-device parameter lives on one rank only)."""
    if _single():
        return flag
    t = torch.tensor([int(flag)], device=device())
    settled(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), [t])
    return bool(t.item())
