"""Client side of rollout-sidecar: call POST /generate from an RL loop.

Needs only httpx and pydantic.
"""

from rollout_sidecar.client.generation_client import AsyncGenerationClient, GenerationClient
from rollout_sidecar.client.protocol import (
    GenerateRequest,
    GenerateResponse,
    Sample,
    SamplingConfig,
)
from rollout_sidecar.client.replica_pool import ReplicaState
from rollout_sidecar.client.request_plans import RetryPolicy, SidecarError

__all__ = [
    "AsyncGenerationClient", "GenerationClient", "GenerateRequest", "GenerateResponse",
    "ReplicaState", "RetryPolicy", "Sample", "SamplingConfig", "SidecarError",
]
