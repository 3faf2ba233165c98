"""The operations the API process asks of our transfer engine inside the vLLM
workers, one Enum shared by both sides instead of strings, and the one way
they travel: every op is a call of the worker method our plugin adds
(`rollout_sidecar_call`), and every worker answers every call with a value.

Why never a raise: vLLM's `MultiprocExecutor.collective_rpc` reads the
workers' replies in rank order and raises at the first failed one, leaving
the replies of the ranks after it unread in their queues (vLLM 0.32,
`v1/executor/multiproc_executor.py:433-449`; vLLM #49972). From then on those
ranks answer each call with their reply to the call before, so with TP >= 2 a
load that failed on rank 1 alone could read as a success, and a commit could
publish shards of two versions. A reply that is a value keeps every queue in
step; this module reads all of them and decides.

`WorkerOp`s run inside vLLM's weight-update session (worker_calls.py opens it
with the receive and closes it with FINISH or ABORT). `SideOp`s run outside
it: connection and receive state, polled while generation goes on.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import WorkerRpc
    from rollout_sidecar.server.weights.worker_replies import Reply
    from rollout_sidecar.server.weights.worker_requests import Request

WORKER_METHOD = "rollout_sidecar_call"


class WorkerOp(str, Enum):
    # Open the session, lay out staging, start the receive of the push's
    # transport (its receive path: worker/receive_paths.py).
    OPEN = "open"
    STAGE = "stage"  # one bucket's bytes, from an HTTP body
    CHECK = "check"  # join the receive, check every bucket's CRC (phase 1: prepare)
    PATCH = "patch"  # a delta: write its patches into the staged copy (model untouched)
    LOAD = "load"  # the commit: load the staged push, all of it or none of it
    FINISH = "finish"  # after a load on every rank: close the session
    ABORT = "abort"  # drop the staged push and close the session; idempotent


class SideOp(str, Enum):
    CONNECT = "connect"  # start joining the trainer's group, in a background thread
    STATE = "state"  # {"connection": ..., "receive": ...}
    DISCONNECT = "disconnect"  # drop the group (a joiner still blocked times out alone)
    RELABEL = "relabel"  # an unchanged push: the staged copy of `base` is `version` too
    HOST = "host"  # what the worker sees of its host: /dev/shm, room there (at start)
    LAYOUT = "layout"  # its role in the staging layout (server/weights/staging_layout.py)
    READ = "read"  # the staged copy's manifest, or one bucket's bytes (a peer catching up)


class WorkerCallFailed(RuntimeError):
    """Some rank answered a call with a failure. `untouched`: every rank
    failed before changing its model (a load refused everywhere), so the
    old weights still serve on all of them."""

    def __init__(self, op: str, replies: list[Reply]) -> None:
        self.op = op
        self.replies = replies
        failed = [r for r in replies if not r.ok]
        self.untouched = len(failed) == len(replies) and all(r.untouched for r in failed)
        super().__init__("; ".join(_named(r, len(replies)) for r in failed))


def _named(reply: Reply, ranks: int) -> str:
    error = reply.error or "failed"
    return error if ranks == 1 else f"worker rank {reply.rank}: {error}"


async def call(llm: WorkerRpc, op: WorkerOp | SideOp, **payload: Any) -> list[Any]:
    """Run `op` on every worker and return every rank's typed reply
    (worker_replies.py: the op's class), in rank order; raise
    `WorkerCallFailed` naming each rank that failed."""
    from rollout_sidecar.server.weights.worker_replies import reply_of

    replies = [reply_of(op, r) for r in
               await llm.collective_rpc(WORKER_METHOD, args=(op.value, payload))]
    if not all(r.ok for r in replies):
        raise WorkerCallFailed(op.value, replies)
    return replies


async def send(llm: WorkerRpc, request: Request) -> None:
    """Run an op's typed request (worker_requests.py) on every worker; raise
    `WorkerCallFailed` if any failed."""
    from rollout_sidecar.server.weights.worker_requests import payload

    await call(llm, request.op, **payload(request))
