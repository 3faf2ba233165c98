"""The operations the API process asks of our transfer engine inside the vLLM
worker, one Enum shared by both sides instead of strings.

`WorkerOp`s travel as `update_weights` calls inside vLLM's update session (a
raise there ends the session). `SideOp`s travel through the worker method our
plugin adds (`rollout_sidecar_call`): outside any session, non-blocking, and
they return data (connection and receive state), so nothing is polled by
raising and the engine core is never blocked waiting for a trainer.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

WORKER_METHOD = "rollout_sidecar_call"


class WorkerOp(str, Enum):
    ALLOCATE = "allocate"  # HTTP transport: lay out staging for the manifest
    RECEIVE = "receive"  # gloo/NCCL: receive every bucket in a background thread
    STAGE = "stage"  # one bucket's bytes, from an HTTP body
    CHECK = "check"  # join the receive, check every bucket's CRC (phase 1: prepare)
    LOAD = "load"  # the commit: load the staged push, all of it or none of it
    ABORT = "abort"  # drop the staged push (raises, which ends vLLM's session)


class SideOp(str, Enum):
    CONNECT = "connect"  # start joining the trainer's group, in a background thread
    STATE = "state"  # {"connection": ..., "receive": ...}
    DISCONNECT = "disconnect"  # drop the group (a joiner still blocked times out alone)


async def send(llm: Any, op: WorkerOp, **info: Any) -> None:
    """Run `op` in every worker, inside vLLM's open update session (API side).

    A raise here has already ended that session (vLLM closes it on error)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await llm.update_weights(WeightTransferUpdateRequest(update_info={"op": op.value, **info}))
