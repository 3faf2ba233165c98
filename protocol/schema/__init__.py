"""The wire types (pydantic only: no torch, no httpx), re-exported here:
`generate_api` (the generation API), `weights_api` (the push control plane),
`manifest_api` (what a push carries), `status_api` (what a server says of its weights),
`adapter_api` (LoRA adapters), `fields` (shared field types), `endpoints`
(the servers' URLs and the bearer header); `routes` (every route: method,
path, access, request and answer types) is imported as a module."""

from rollout_sidecar.protocol.schema.adapter_api import AdapterSpec, LoraStatus
from rollout_sidecar.protocol.schema.drafter_api import (
    DRAFT,
    DRAFT_PREFIX,
    DrafterStatus,
    DraftOutcome,
    is_draft,
)
from rollout_sidecar.protocol.schema.fields import CommitPolicy, FinishReason
from rollout_sidecar.protocol.schema.generate_api import (
    ErrorItem,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    InfoResponse,
    PromptResult,
    Sample,
    SamplingConfig,
    Usage,
    VersionSpan,
)
from rollout_sidecar.protocol.schema.manifest_api import BucketManifest, PatchInfo, TensorSlot
from rollout_sidecar.protocol.schema.status_api import (
    DrainRequest,
    DrainResponse,
    StagedCopy,
    TensorInfo,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.protocol.schema.weights_api import (
    CAPABILITIES,
    CHAIN_RING,
    CHECK_SUM64,
    CHUNKS_INTERLEAVED,
    PIECES_SLOTS,
    REQUIRES_BUCKET_MACS,
    REQUIRES_SECRET,
    SENDERS,
    SENDERS_NCCL,
    AbortRequest,
    BeginRequest,
    BeginResponse,
    Check,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    DisconnectRequest,
    DisconnectResponse,
    LastPush,
    PrepareRequest,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
    Transport,
)

__all__ = [
    "CAPABILITIES", "CHAIN_RING", "CHECK_SUM64", "CHUNKS_INTERLEAVED", "DRAFT",
    "DRAFT_PREFIX", "PIECES_SLOTS", "REQUIRES_BUCKET_MACS", "REQUIRES_SECRET", "SENDERS",
    "SENDERS_NCCL",
    "DraftOutcome", "DrafterStatus", "is_draft",
    "AbortRequest", "AdapterSpec", "BeginRequest", "BeginResponse", "BucketManifest",
    "Check", "CommitPolicy", "CommitRequest", "CommitResponse", "ConnectRequest", "ConnectResponse",
    "DisconnectRequest", "DisconnectResponse", "ErrorItem", "ErrorResponse", "FinishReason",
    "GenerateRequest", "GenerateResponse", "HealthResponse", "InfoResponse", "LastPush",
    "LoraStatus", "PatchInfo", "PrepareRequest", "PrepareResponse", "ProbeRequest",
    "DrainRequest", "DrainResponse", "ProbeResult", "PromptResult", "Sample",
    "SamplingConfig", "StagedCopy", "TensorInfo",
    "TensorSlot", "Transport", "Usage", "VersionSpan", "WeightIndex", "WeightStatus",
]
