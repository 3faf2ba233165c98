"""Client side of rollout-sidecar: call POST /generate from an RL loop.

Needs only httpx and pydantic. `rollout_sidecar.client.protocol`, the wire
types every side shares, needs pydantic alone: the names below are loaded on
first use, so the trainer and the server import the protocol without httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncGenerationClient": "rollout_sidecar.client.generation_client",
    "GenerationClient": "rollout_sidecar.client.generation_client",
    "RetryPolicy": "rollout_sidecar.client.request_plans",
    "SidecarError": "rollout_sidecar.client.request_plans",
    "LivenessPolicy": "rollout_sidecar.client.liveness",
    "ReplicaState": "rollout_sidecar.client.replica_pool",
    "GenerateRequest": "rollout_sidecar.client.protocol",
    "GenerateResponse": "rollout_sidecar.client.protocol",
    "Sample": "rollout_sidecar.client.protocol",
    "SamplingConfig": "rollout_sidecar.client.protocol",
    "VersionSpan": "rollout_sidecar.client.protocol",
}

__all__ = [
    "AsyncGenerationClient", "GenerateRequest", "GenerateResponse", "GenerationClient",
    "LivenessPolicy", "ReplicaState", "RetryPolicy", "Sample", "SamplingConfig", "SidecarError",
    "VersionSpan",
]

if TYPE_CHECKING:
    from rollout_sidecar.client.generation_client import (
        AsyncGenerationClient,
        GenerationClient,
    )
    from rollout_sidecar.client.liveness import LivenessPolicy
    from rollout_sidecar.client.protocol import (
        GenerateRequest,
        GenerateResponse,
        Sample,
        SamplingConfig,
        VersionSpan,
    )
    from rollout_sidecar.client.replica_pool import ReplicaState
    from rollout_sidecar.client.request_plans import RetryPolicy, SidecarError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value
