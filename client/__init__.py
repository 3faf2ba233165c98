"""The rollout client: call POST /generate (and the OpenAI routes' versions)
from an RL loop, across replicas, with retries and a liveness watch.

Needs only httpx and pydantic, never torch. The wire types come from
`rollout_sidecar.protocol.schema`, which every side shares; the common ones
are re-exported here.
"""

from rollout_sidecar.client.generation_client import AsyncGenerationClient, GenerationClient
from rollout_sidecar.client.replica_pool import ReplicaState
from rollout_sidecar.client.request_plans import RetryPolicy, SidecarError
from rollout_sidecar.protocol.calls.liveness import LivenessPolicy
from rollout_sidecar.protocol.schema import (
    GenerateRequest,
    GenerateResponse,
    Sample,
    SamplingConfig,
    VersionSpan,
)

__all__ = [
    "AsyncGenerationClient", "GenerateRequest", "GenerateResponse", "GenerationClient",
    "LivenessPolicy", "ReplicaState", "RetryPolicy", "Sample", "SamplingConfig", "SidecarError",
    "VersionSpan",
]
