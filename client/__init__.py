"""Client side of rollout-sidecar: call POST /generate from an RL loop.

Needs only httpx and pydantic.
"""

from rollout_sidecar.client.generation_client import AsyncGenerationClient, GenerationClient
from rollout_sidecar.client.http import RetryPolicy, SidecarError
from rollout_sidecar.client.router import ReplicaState
from rollout_sidecar.client.schema import (
    GenerateRequest,
    GenerateResponse,
    Sample,
    SamplingConfig,
)

__all__ = [
    "AsyncGenerationClient", "GenerationClient", "GenerateRequest", "GenerateResponse",
    "ReplicaState", "RetryPolicy", "Sample", "SamplingConfig", "SidecarError",
]
