"""Wire types of what a server says of its weights (pydantic only): what a
push must carry (`GET /weights/index`), where it stands
(`GET /weights/status`), the staged copy a replica catching up reads
(`GET /weights/staged`), and a replica's leave (`POST /drain`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from rollout_sidecar.protocol.schema.adapter_api import LoraStatus
from rollout_sidecar.protocol.schema.drafter_api import DrafterStatus
from rollout_sidecar.protocol.schema.fields import ReplyModel, StrictModel
from rollout_sidecar.protocol.schema.manifest_api import BucketManifest
from rollout_sidecar.protocol.schema.weights_api import LastPush, ProbeResult


class TensorInfo(BaseModel):
    shape: list[int]
    dtype: str = Field(description="dtype a push carries it in.")


class WeightIndex(BaseModel):
    """`GET /weights/index`: what a push must carry."""

    tensors: dict[str, TensorInfo] = Field(
        description="Every tensor a push must carry: parameters and persistent buffers.")
    ignored: list[str] = Field(
        description="Checkpoint tensors vLLM drops at load (e.g. rotary_emb.inv_freq): never "
        "pushed.")
    tie_word_embeddings: bool
    draft: list[str] = Field(
        default_factory=list, description="Of `tensors`, the speculative drafter's (`draft.` "
        "names): a push carries all of them (the drafter synced) or none (frozen).")


class WeightStatus(ReplyModel):
    weight_version: int
    dtype: str
    quantization: str | None = Field(
        None, description="vLLM's online quantization scheme (`serve --quantization`), or "
        "null. Pushes carry `dtype`; every one is re-quantized as a fresh load would be.")
    vocab_size: int
    max_model_len: int
    boot_id: str = Field(description="New at every server start: a change means the server "
                         "restarted, back on its checkpoint's weights.")
    push_state: Literal["idle", "receiving", "checking", "prepared", "committing"]
    push_in_progress: bool
    push_id: str | None = None
    connected: str | None = Field(description="Connection id of the data plane, if any.")
    data_plane_port: int
    data_plane_ranks: int = Field(1, description="Workers of this server in the data-plane "
                                  "group: TP x PP x DP, or one per host and engine where the "
                                  "workers share a staged copy (`staging_layout`).")
    staging_layout: str | None = Field(
        None, description="Where this server's workers stage a push, as decided at start: "
        "one copy per host in /dev/shm (its first worker receives) or one per worker, and "
        "why (docs/deploy.md, \"Sizing /dev/shm\").")
    transports: list[str]
    capabilities: list[str] = Field(
        default_factory=list, description="What this server takes beyond the first protocol, "
        "for a trainer to ask before it uses it: `senders` (buckets from several trainer "
        "ranks, `ConnectRequest.senders`), `senders:nccl` (the same over NCCL), "
        "`check:sum64` (`BeginRequest.check`), `chunks:interleaved` (a split tensor's chunks "
        "in any order: `TensorSlot`), `chain:ring` (`ConnectRequest.ring_starts`), `pieces:slots` "
        "(`ConnectRequest.slot_pieces`), `draft` "
        "(a drafter that takes pushes).")
    requires: list[str] = Field(
        default_factory=list, description="What this server refuses a connect without: "
        "`data_plane_secret` (`ConnectRequest.secret`), `bucket_macs` (every bucket tagged "
        "with it; WeightPusher then tags its buckets).")
    push_timeout_s: float = Field(description="The deadline of one push, begin to commit.")
    commit_drain_s: float = Field(description="Longest wait for in-flight requests at a commit.")
    broken: str | None = Field(None, description="Set after a load failed mid-commit: "
                               "/generate answers 503 until a push succeeds.")
    last_push: LastPush | None = None
    last_probe: ProbeResult | None = Field(
        None, description="The trainer's post-push probe of the latest version that ran one.")
    suspect: str | None = Field(
        None, description="Why the served version is suspect (its probe failed), else null.")
    delta_base: int | None = Field(
        None, description="The version this replica's staged copy holds, bit for bit: the "
        "base a delta push must name. Null after a restart or a failed load, and while a "
        "dense push is under way: the next push must be dense.")
    lora: LoraStatus | None = Field(
        None, description="LoRA adapter pushes: null unless the server was started with "
        "--enable-lora.")
    catch_up: dict[str, float | int | str | dict[str, str]] | None = Field(
        None, description="This replica's catch-up from a peer at start (--peers): the peer, "
        "the version, seconds from the catch-up's start to finding it, receiving it and "
        "committing it, or why it did not happen; `fleet_version`: the newest version a proven "
        "peer served; `held`: why generation stays refused (a catch-up that failed behind "
        "the fleet) until a push commits; `refused`: each peer that could not prove "
        "it holds the admin token, and why. Null without peers.")
    drafter: DrafterStatus | None = Field(
        None, description="The speculative drafter (`serve --speculative-config`), or null.")
    staged_bytes: int | None = Field(
        None, description="Bytes of staging buffers all of this server's workers held when "
        "the last push ended (the staged copy a delta applies to, plus pooled buffers; "
        "docs/gpu.md gives the formula). Null before the first push.")


class StagedCopy(BaseModel):
    """`GET /weights/staged`: the version this replica's staged copy holds bit
    for bit and its buckets, for a replica catching up from it (each bucket's
    bytes at `GET /weights/staged/{index}`)."""

    version: int
    buckets: list[BucketManifest]


class DrainRequest(StrictModel):
    """`POST /drain`: stop taking work and wait until none is left."""

    timeout_s: float = Field(
        gt=0, description="How long to wait for the work in flight. Required, so that a "
        "call with an empty body drains nothing: a drain cannot be undone.")


class DrainResponse(ReplyModel):
    """What a drain waited for, and whether anything is left."""

    drained: bool = Field(description="Nothing in flight: no request, no push, and no push "
                          "call for a second.")
    waited_s: float
    requests_in_flight: int
    push_in_flight: str | None = Field(default=None, description="The push still running, "
                                       "if the wait ran out.")
