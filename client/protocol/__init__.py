"""The protocol every side speaks: the neutral layer that the trainer, the
server and the client import, and that imports none of them.

- `generate_api`, `weights_api`, `adapter_api` (pydantic only, re-exported
  here): every JSON type of the generation API and of the push control plane.
- `wire_format` (torch): dtype names, CRC-32 and slot views of the bucket
  bytes. `bucket_group` (torch.distributed): the data plane's process group,
  and how one bucket is sent and received; `signed_store` (torch.distributed):
  its signed rendezvous. `bucket_mac` (torch): each bucket's keyed tag.
  `delta_codec` (torch): a tensor's sparse patches. Import those five by name;
  this package and the client never import torch.
"""

from rollout_sidecar.client.protocol.adapter_api import AdapterSpec, LoraStatus
from rollout_sidecar.client.protocol.fields import CommitPolicy, FinishReason
from rollout_sidecar.client.protocol.generate_api import (
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
from rollout_sidecar.client.protocol.weights_api import (
    AbortRequest,
    BeginRequest,
    BeginResponse,
    BucketManifest,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    DisconnectRequest,
    DisconnectResponse,
    LastPush,
    PatchInfo,
    PrepareRequest,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
    TensorInfo,
    TensorSlot,
    Transport,
    WeightIndex,
    WeightStatus,
)

__all__ = [
    "AbortRequest", "AdapterSpec", "BeginRequest", "BeginResponse", "BucketManifest",
    "CommitPolicy", "CommitRequest", "CommitResponse", "ConnectRequest", "ConnectResponse",
    "DisconnectRequest", "DisconnectResponse", "ErrorItem", "ErrorResponse", "FinishReason",
    "GenerateRequest", "GenerateResponse", "HealthResponse", "InfoResponse", "LastPush",
    "LoraStatus", "PatchInfo", "PrepareRequest", "PrepareResponse", "ProbeRequest",
    "ProbeResult", "PromptResult", "Sample", "SamplingConfig", "TensorInfo", "TensorSlot",
    "Transport", "Usage", "VersionSpan", "WeightIndex", "WeightStatus",
]
