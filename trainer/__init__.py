"""Trainer side of rollout-sidecar: gather full weights from FSDP2, FSDP1, DDP
or plain modules, bucket by bucket, and push them to the server. Needs torch
(and httpx for the control plane), never vLLM."""

from rollout_sidecar.trainer.errors import (
    NonFiniteWeightsError,
    PartialCommitError,
    ReplicaError,
    ReplicaLostError,
    ServerRestartedError,
    WeightMismatchError,
    WeightPushError,
)
from rollout_sidecar.trainer.gather.full_tensors import MetaDeviceError
from rollout_sidecar.trainer.push_result import PushResult
from rollout_sidecar.trainer.pusher import WeightPusher

__all__ = ["MetaDeviceError", "NonFiniteWeightsError", "PartialCommitError", "PushResult",
           "ReplicaError", "ReplicaLostError", "ServerRestartedError", "WeightMismatchError",
           "WeightPushError", "WeightPusher"]
