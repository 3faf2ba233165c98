"""What each op answers: one typed reply per kind, the mirror of
worker_requests.py. Every rank answers every call with a value, never a raise
(ops.py says why), so each reply carries its rank, whether the op succeeded
there and why not; then what its op reports.

A reply crosses vLLM's RPC as a plain dict (the engine core's msgpack encoder
takes no classes of ours): the worker builds the op's class and flattens it
(`wire`, worker_calls.py), and the API process builds the same class back
(`reply_of`, ops.py), so a key that one side sends and the other does not
know fails by name on whichever side meets it first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from rollout_sidecar.server.weights.ops import SideOp, WorkerOp


class ConnectionState(TypedDict, total=False):
    """A worker's data-plane connection (worker/group_membership.py)."""

    state: Literal["none", "connecting", "connected", "failed"]
    id: str  # the connection's id, once it has one
    error: str  # why it failed


@dataclass(frozen=True)
class Reply:
    rank: int  # across the server's engines: dp_index * world_size + rank (vLLM's)
    ok: bool
    error: str | None = None
    untouched: bool = False  # failed before this rank changed its model (LoadRefused)


@dataclass(frozen=True)
class Done(Reply):
    """A `WorkerOp`'s; FINISH and ABORT say what staging still holds."""

    staged_bytes: int = 0


@dataclass(frozen=True)
class State(Reply):
    """The side ops' but HOST's and READ's: the worker's connection and
    receive, polled while generation goes on."""

    connection: ConnectionState = field(default_factory=lambda: ConnectionState(state="none"))
    receive: Literal["idle", "running", "failed"] = "idle"
    receive_error: str | None = None
    staged_bytes: int = 0


@dataclass(frozen=True)
class Host(Reply):
    """SideOp.HOST: what the worker sees of its host (worker/host_share.py)."""

    dp_index: int = 0
    host: str = ""
    net: str = ""  # equal for workers on one network stack
    shm: str | None = None  # equal for workers that share one /dev/shm; None: none
    shm_free: int = 0
    shm_total: int = 0


@dataclass(frozen=True)
class Staged(Reply):
    """SideOp.READ, from worker rank 0 (the others answer empty): the staged
    copy's version and its manifest, or one bucket's bytes."""

    version: int | None = None
    manifest: list[dict[str, Any]] | None = None
    data: bytes | None = None


REPLIES: dict[WorkerOp | SideOp, type[Reply]] = {
    **{op: Done for op in WorkerOp}, **{op: State for op in SideOp},
    SideOp.HOST: Host, SideOp.READ: Staged}


def wire(reply: Reply) -> dict[str, Any]:
    """The reply as it crosses vLLM's RPC (shallow: a bucket's bytes are not
    copied)."""
    return {f.name: getattr(reply, f.name) for f in dataclasses.fields(reply)}


def reply_of(op: WorkerOp | SideOp, fields: dict[str, Any]) -> Reply:
    """The API process's side: the typed reply of `op`; a ValueError names
    what does not fit."""
    try:
        return REPLIES[op](**fields)
    except TypeError as e:
        raise ValueError(f"{op.value} reply: {e}") from None
