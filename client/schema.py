"""Every type that crosses the wire, in one module.

The server validates requests with these models and the client parses
responses with them, so the two can never drift apart. Only pydantic is
imported here: the trainer and the client must not pull in vLLM.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator

FinishReason = Literal["stop", "length", "abort"]
CommitPolicy = Literal["wait", "abort", "keep"]


def _no_bool(v: object) -> object:
    # pydantic would read JSON true/false as 1/0; the schema says number.
    if isinstance(v, bool):
        raise ValueError("a boolean is not a number")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), BeforeValidator(_no_bool)]],
                     Field(min_length=1)]
Bool = Annotated[bool, Strict()]  # true or false, not 1 or "yes"
# Constraints before the validator, or the schema of `Port | None` shows raw ge/le.
Port = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_no_bool)]


def _not_null(schema: dict[str, Any]) -> None:
    # An optional field whose explicit null is refused: document it without null.
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        schema.update(branches[0])
    schema.pop("default", None)


class _Strict(BaseModel):
    # Unknown fields are an error, so a typo ("max_token") fails loudly with 422
    # instead of silently falling back to a default.
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    # JSON has no NaN or infinity. A diverged model's logprobs go out as the
    # strings "NaN", "Infinity", "-Infinity", which pydantic (the client) parses
    # back into floats, instead of a null that breaks `list[float]`.
    model_config = ConfigDict(ser_json_inf_nan="strings")


# --------------------------------------------------------------------- generate


def _range(**bounds: object) -> dict:
    # In the OpenAPI schema, but checked by `range_error`, so that an
    # out-of-range value is a 400 naming the field rather than a 422.
    return {"json_schema_extra": bounds}


class SamplingConfig(_Strict):
    """Sampling parameters, applied to every prompt of a request.

    Types are checked by pydantic (a wrong type is a 422); value ranges are
    checked by `range_error` (an out-of-range value is a 400 with the reason).
    The ranges are vLLM's own, so nothing reaches the engine it would refuse.
    """

    n: Int = Field(1, description="Samples per prompt, 1..1024.",
                   **_range(minimum=1, maximum=1024))
    max_tokens: Int = Field(64, description="New tokens per sample at most, >= 1.",
                            **_range(minimum=1))
    temperature: Float = Field(1.0, description="0 is greedy; 0..2 (vLLM's range).",
                               **_range(minimum=0, maximum=2))
    top_p: Float = Field(1.0, description="Nucleus mass, (0, 1].",
                         **_range(exclusiveMinimum=0, maximum=1))
    top_k: Int = Field(0, description="0 disables top-k; else >= 1.", **_range(minimum=0))
    seed: Int | None = Field(None, description="Same seed, same request: same tokens.",
                             **_range(minimum=-(2**63), maximum=2**63 - 1))
    stop: list[str] = Field(default_factory=list, description="Stop strings: at most 64, each "
                            "1..1024 characters.",
                            **_range(maxItems=64, items={"type": "string", "minLength": 1,
                                                         "maxLength": 1024}))
    logprobs: Bool = Field(True, description="Return the logprob of each sampled token.")
    prompt_logprobs: Bool = Field(
        False, description="Also return the logprob of every prompt token under the served "
        "weights (vLLM's prompt_logprobs): scoring for reference-model or recomputed old "
        "logprobs. Use max_tokens=1 to score only.")

    def range_error(self) -> tuple[str, str] | None:
        """(field, reason) of the first out-of-range value, or None."""
        checks = [
            ("n", 1 <= self.n <= 1024, "must be in 1..1024"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits"),
            ("stop", len(self.stop) <= 64, "at most 64 stop strings"),
            ("stop", all(1 <= len(s) <= 1024 for s in self.stop),
             "stop strings must be 1..1024 characters"),
        ]
        for name, ok, why in checks:
            if not ok:
                return f"sampling.{name}", f"sampling.{name}={getattr(self, name)!r} {why}"
        return None


class GenerateRequest(_Strict):
    """`POST /generate`: give exactly one of `prompts` or `prompt_token_ids`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompts"]}, {"required": ["prompt_token_ids"]}]})

    prompts: list[str] | None = Field(None, min_length=1, json_schema_extra=_not_null)
    prompt_token_ids: list[TokenIds] | None = Field(None, min_length=1,
                                                    json_schema_extra=_not_null)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    min_weight_version: Int | None = Field(
        None,
        description="Wait (bounded) until the server holds at least this weight version.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_null_prompts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("prompts", "prompt_token_ids"):
                if key in data and data[key] is None:
                    raise ValueError(f"'{key}' is null: leave it out instead")
        return data

    @model_validator(mode="after")
    def _exactly_one_prompt_kind(self) -> GenerateRequest:
        if (self.prompts is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompts' or 'prompt_token_ids'")
        if self.prompt_token_ids is not None and any(
            len(ids) == 0 for ids in self.prompt_token_ids
        ):
            raise ValueError("'prompt_token_ids' must not contain an empty prompt")
        return self

    @property
    def num_prompts(self) -> int:
        return len(self.prompts if self.prompts is not None else self.prompt_token_ids or [])


class Sample(_Reply):
    """One sampled continuation."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = Field(
        None, description="Logprob of each sampled token under the serving weights "
        "(raw, before temperature/top-p). Non-finite values are the strings 'NaN', "
        "'Infinity', '-Infinity'; the client parses them into floats."
    )
    finish_reason: FinishReason


class PromptResult(_Reply):
    prompt_token_ids: list[int]
    samples: list[Sample]
    prompt_logprobs: list[float | None] | None = Field(
        None, description="With sampling.prompt_logprobs: the logprob of each prompt token "
        "given the ones before it; the first is null (nothing precedes it)."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(_Reply):
    results: list[PromptResult]
    weight_version: int = Field(description="Weight version every token came from.")
    weight_versions: list[int] = Field(
        description="All versions that produced tokens; more than one only with "
        "commit policy 'keep'."
    )
    weight_suspect: bool = Field(
        False, description="True if the trainer's post-push probe found one of "
        "weight_versions serving logprobs beyond tolerance from its own forward pass "
        "(see /weights/status). Such tokens are not from the trained policy."
    )
    boot_id: str = Field("", description="The server process's boot id (see /weights/status).")
    usage: Usage


# ------------------------------------------------------------------ status


class InfoResponse(BaseModel):
    model: str
    dtype: str
    lm_head_dtype: str = Field(description="dtype the lm_head's logits are computed in.")
    max_model_len: int
    vocab_size: int
    weight_version: int
    boot_id: str
    num_parameters: int
    commit_policy: CommitPolicy
    transports: list[str]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the server answers: what went wrong, the field it
    names (dotted, e.g. `sampling.top_p`), and for a 422 every schema error."""

    error: str
    field: str | None = None
    detail: list[ErrorItem] | None = None


# --------------------------------------------------------------------- weights
# Control plane of a push. The bytes travel over torch.distributed (gloo/NCCL)
# or, with transport "http", as bodies of PUT /weights/bucket/{index}.

Transport = Literal["gloo", "nccl", "http"]


class ParamSlot(_Strict):
    """Where one tensor, or one chunk of it, sits inside a packed bucket.
    Floating tensors travel in the serving dtype; integer and bool tensors
    (persistent buffers such as routing tables) in their own. A tensor larger
    than a bucket is split: its chunks, in consecutive entries, carry
    `chunk_offset` and `nbytes` and cover its bytes exactly once, in order."""

    name: str
    dtype: str
    shape: list[Int] = Field(description="The whole tensor's shape, also for a chunk.")
    offset: Int = Field(description="Byte offset in the bucket; aligned to the dtype size.")
    chunk_offset: Int | None = Field(
        None, json_schema_extra=_not_null,
        description="A chunk: where it starts in the tensor's bytes (C order, wire dtype). "
        "Absent: the entry is the whole tensor.")
    nbytes: Int | None = Field(None, json_schema_extra=_not_null,
                               description="A chunk: its length in bytes; with chunk_offset.")


class BucketManifest(_Strict):
    index: Int
    nbytes: Int
    params: list[ParamSlot]


class ConnectRequest(_Strict):
    connection_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: Float = Field(300.0, gt=0, le=3600, description="How long to wait for the "
                             "trainer to join the group (capped by the server).")
    takeover: Bool = Field(False, description="Replace another trainer's connection even "
                           "within its lease (that trainer's next begin is refused).")
    trainer_id: str | None = Field(
        None, max_length=128, description="The pusher's id: the trainer that owns the data "
        "plane may replace its own connection within the lease (to bring a restarted replica "
        "back into the group).")
    world_size: Int = Field(2, ge=2, le=65536, description="Ranks in the group: the trainer "
                            "(rank 0) plus every worker of every replica.")
    rank_offset: Int = Field(1, ge=1, description="This server's first worker rank; its "
                             "workers take rank_offset .. rank_offset + data_plane_ranks - 1.")
    store_host: str | None = Field(None, max_length=255, description="Rendezvous store host "
                                   "(another replica's data plane); default: this server's.")
    store_port: Port | None = Field(None, description="Rendezvous store port; default: this "
                                    "server's data-plane port.")
    fanout: Literal["broadcast", "chain"] = Field(
        "broadcast", description="How each bucket reaches every rank: one broadcast, or "
        "(gloo) a chain that relays it piece by piece from rank to rank, so rank 0 sends it "
        "once however many replicas listen.")


class ConnectResponse(BaseModel):
    connection_id: str
    backend: str


class BeginRequest(_Strict):
    version: Int = Field(description="Weight version this push becomes; must increase.")
    transport: Transport = "gloo"
    connection_id: str | None = Field(
        None, description="gloo/nccl: the connection that carries the data; it must own the "
        "data plane.")
    commit_policy: CommitPolicy | None = Field(
        None, description="In-flight requests at this push's commit; default: the server's.")
    buckets: list[BucketManifest] = Field(min_length=1)


class BeginResponse(BaseModel):
    push_id: str
    deadline_s: float = Field(description="The push must commit within this; the server ends "
                              "it after.")
    commit_policy: CommitPolicy


class PrepareRequest(_Strict):
    """Phase 1 of a commit across replicas: every bucket arrived and matches."""

    push_id: str
    checksums: list[Int] = Field(description="CRC-32 of each bucket's bytes, in order.")


class PrepareResponse(BaseModel):
    push_id: str
    deadline_s: float = Field(description="Commit (phase 2) or abort within this; the server "
                              "aborts the prepared push after.")
    timings: dict[str, float]


class CommitRequest(_Strict):
    push_id: str
    checksums: list[Int] | None = Field(
        None, description="CRC-32 of each bucket's bytes, in order; needed unless the push "
        "was prepared (POST /weights/prepare), which checked them already.")


class CommitResponse(BaseModel):
    weight_version: int
    push_id: str
    commit_policy: CommitPolicy = Field(description="The policy the commit used: `abort` if "
                                        "a `wait` drain ran past commit_drain_s.")
    timings: dict[str, float]


class AbortRequest(_Strict):
    push_id: str
    reason: str = "aborted by trainer"


class LastPush(BaseModel):
    version: int
    outcome: Literal["committed", "failed", "aborted"]
    reason: str | None = None
    push_id: str | None = None


class ProbeRequest(_Strict):
    """`POST /weights/verify`: the trainer's logprobs of a fixed token sequence,
    computed by its own forward pass right after pushing `version`."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    version: Int = Field(description="The version just committed; must be the served one.")
    token_ids: list[Int] = Field(min_length=2, max_length=4096)
    trainer_logprobs: list[Float] = Field(
        description="logprob of token_ids[i] given token_ids[:i], for i = 1..len-1.")
    tolerance: Float = Field(gt=0, description="Largest acceptable mean |dlogp|.")


class ProbeResult(_Reply):
    version: int
    mean_abs_dlogp: float = Field(description="Mean |served - trainer| over the probe tokens.")
    max_abs_dlogp: float
    tolerance: float
    passed: bool
    tokens: int


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


class WeightStatus(_Reply):
    weight_version: int
    dtype: str
    vocab_size: int
    max_model_len: int
    boot_id: str = Field(description="New at every server start: a change means the server "
                         "restarted, back on its checkpoint's weights.")
    push_state: Literal["idle", "receiving", "verifying", "prepared", "committing"]
    push_in_progress: bool
    push_id: str | None = None
    connected: str | None = Field(description="Connection id of the data plane, if any.")
    data_plane_port: int
    data_plane_ranks: int = Field(1, description="Workers of this server in the data-plane "
                                  "group (TP x PP x DP).")
    transports: list[str]
    push_timeout_s: float = Field(description="The deadline of one push, begin to commit.")
    commit_drain_s: float = Field(description="Longest wait for in-flight requests at a commit.")
    broken: str | None = Field(None, description="Set after a load failed mid-commit: "
                               "/generate answers 503 until a push succeeds.")
    last_push: LastPush | None = None
    last_probe: ProbeResult | None = Field(
        None, description="The trainer's post-push probe of the latest version that ran one.")
    suspect: str | None = Field(
        None, description="Why the served version is suspect (its probe failed), else null.")
