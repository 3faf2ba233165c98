"""The worker's end of ops.py: every call answered with a value, never a raise.

vLLM's executor stops reading replies at the first failed rank (see ops.py),
so a raise on one TP worker would put every later reply out of step. Here each
call's outcome is caught and returned as the op's typed reply
(worker_replies.py: rank, ok, error, untouched, then what the op reports),
and the API process reads every rank's and decides.

vLLM's weight-update session is opened with the receive and closed by FINISH
(after a load) or ABORT (anything else), on every rank, whatever happened on
the others: a session left open on one rank would refuse that rank's next
`start_weight_update`. ABORT is idempotent, so the API sends it after any
failure without knowing which ranks still had a session.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from typing import TYPE_CHECKING

from rollout_sidecar.server.weights.ops import SideOp, WorkerOp
from rollout_sidecar.server.weights.worker.draft_loading import drafter_of
from rollout_sidecar.server.weights.worker.reload import LoadRefused
from rollout_sidecar.server.weights.worker_replies import REPLIES, Reply, wire
from rollout_sidecar.server.weights.worker_requests import parse

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.worker.transfer_engine import (
        StagedWeightTransferEngine,
    )
    from rollout_sidecar.server.weights.worker.vllm_worker import VllmWorker

log = logging.getLogger(__name__)

_SIDE_OPS = {o.value for o in SideOp}
# A side op returns at once by design (its blocking work runs in threads); one
# still running after this long is a bug, so every thread's stack goes to the
# log while it is still stuck. Worker ops may rightly take minutes (a load).
SIDE_OP_STACKS_AFTER_S = 15.0


def run_call(worker: VllmWorker, op: str, payload: dict) -> dict:
    """One rank's answer to one call: its typed reply, on the wire."""
    pc = worker.parallel_config
    rank = pc.data_parallel_index * pc.world_size + worker.rank
    kind = next((REPLIES[o] for o in (*WorkerOp, *SideOp) if o.value == op), Reply)
    try:
        engine = worker.weight_transfer_engine
        if engine is None:
            raise RuntimeError("weight transfer is not configured on this worker")
        if engine.drafter is None:
            engine.drafter = drafter_of(worker)
        if op in _SIDE_OPS:
            faulthandler.dump_traceback_later(SIDE_OP_STACKS_AFTER_S, file=sys.stderr)
            data: dict | None
            try:
                data = engine.side_call(op, payload)
            finally:
                faulthandler.cancel_dump_traceback_later()
        else:
            data = _worker_op(worker, engine, WorkerOp(op), payload)
        return wire(kind(rank=rank, ok=True, **(data or {})))
    except Exception as e:
        log.warning("rank %d: %s failed: %s", rank, op, e)
        return wire(kind(rank=rank, ok=False, error=str(e) or type(e).__name__,
                         untouched=isinstance(e, LoadRefused)))


def _session_open(worker: VllmWorker) -> bool:
    return bool(getattr(worker, "_weight_update_active", False))


def _worker_op(worker: VllmWorker, engine: StagedWeightTransferEngine, op: WorkerOp,
               payload: dict) -> dict | None:
    if op is WorkerOp.ABORT:
        _close(worker, engine)
        return {"staged_bytes": engine.staged_bytes}
    if op is WorkerOp.FINISH:
        if _session_open(worker):
            worker.finish_weight_update()
        return {"staged_bytes": engine.staged_bytes}
    if op is WorkerOp.OPEN:
        _close(worker, engine)  # one left open by a push that never ended here
        worker.start_weight_update()
    elif not _session_open(worker):
        raise RuntimeError(f"{op.value}: no push is staged on this worker (its receive "
                           "failed or the push was aborted)")
    # vLLM's update_weights ends the session if the op raises (gpu_worker.py);
    # it hands the request to our engine's `update_weights` as it is.
    worker.update_weights(parse(op, payload))
    return None


def _close(worker: VllmWorker, engine: StagedWeightTransferEngine) -> None:
    """Drop whatever push is staged and end vLLM's session, if open."""
    engine.discard()
    if _session_open(worker):
        worker.finish_weight_update()
