"""Every type that crosses the wire, in one module.

The server validates requests with these models and the client parses
responses with them, so the two can never drift apart. Only pydantic is
imported here: the trainer and the client must not pull in vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]
CommitPolicy = Literal["wait", "abort", "keep"]


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


class SamplingConfig(_Strict):
    """Sampling parameters, applied to every prompt of a request.

    Types are checked by pydantic (a wrong type is a 422); value ranges are
    checked by `range_error` (an out-of-range value is a 400 with the reason).
    """

    n: int = Field(1, description="Samples per prompt, 1..1024.")
    max_tokens: int = Field(64, description="New tokens per sample at most, >= 1.")
    temperature: float = Field(1.0, description="0 is greedy; 0..100.")
    top_p: float = Field(1.0, description="Nucleus mass, (0, 1].")
    top_k: int = Field(0, description="0 disables top-k; else >= 1.")
    seed: int | None = Field(None, description="Same seed, same request: same tokens.")
    stop: list[str] = Field(default_factory=list, description="Stop strings, at most 64.")
    logprobs: bool = Field(True, description="Return the logprob of each sampled token.")
    prompt_logprobs: bool = Field(
        False, description="Also return the logprob of every prompt token under the served "
        "weights (vLLM's prompt_logprobs): scoring for reference-model or recomputed old "
        "logprobs. Use max_tokens=1 to score only.")

    def range_error(self) -> tuple[str, str] | None:
        """(field, reason) of the first out-of-range value, or None."""
        checks = [
            ("n", 1 <= self.n <= 1024, "must be in 1..1024"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("stop", len(self.stop) <= 64, "at most 64 stop strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                return f"sampling.{name}", f"sampling.{name}={getattr(self, name)!r} {why}"
        return None


class GenerateRequest(_Strict):
    """`POST /generate`: give exactly one of `prompts` or `prompt_token_ids`."""

    prompts: list[str] | None = Field(None, min_length=1)
    prompt_token_ids: list[list[int]] | None = Field(None, min_length=1)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    min_weight_version: int | None = Field(
        None,
        description="Wait (bounded) until the server holds at least this weight version.",
    )

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
    usage: Usage


# ------------------------------------------------------------------ status


class InfoResponse(BaseModel):
    model: str
    dtype: str
    lm_head_dtype: str = Field(description="dtype the lm_head's logits are computed in.")
    max_model_len: int
    vocab_size: int
    weight_version: int
    num_parameters: int
    commit_policy: CommitPolicy
    transports: list[str]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the server answers on purpose."""

    error: str
    field: str | None = None


# --------------------------------------------------------------------- weights
# Control plane of a push. The bytes travel over torch.distributed (gloo/NCCL)
# or, with transport "http", as bodies of PUT /weights/bucket/{index}.

Transport = Literal["gloo", "nccl", "http"]


class ParamSlot(_Strict):
    """Where one tensor sits inside a packed bucket. Floating tensors travel in
    the serving dtype; integer and bool tensors (persistent buffers such as
    routing tables) in their own."""

    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(description="Byte offset in the bucket; aligned to the dtype size.")


class BucketManifest(_Strict):
    index: int
    nbytes: int
    params: list[ParamSlot]


class ConnectRequest(_Strict):
    connection_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(300.0, gt=0)


class ConnectResponse(BaseModel):
    connection_id: str
    backend: str


class BeginRequest(_Strict):
    version: int = Field(description="Weight version this push becomes; must increase.")
    transport: Transport = "gloo"
    buckets: list[BucketManifest] = Field(min_length=1)


class BeginResponse(BaseModel):
    push_id: str
    deadline_s: float


class CommitRequest(_Strict):
    push_id: str
    checksums: list[int] = Field(description="CRC-32 of each bucket's bytes, in order.")


class CommitResponse(BaseModel):
    weight_version: int
    timings: dict[str, float]


class AbortRequest(_Strict):
    push_id: str
    reason: str = "aborted by trainer"


class LastPush(BaseModel):
    version: int
    outcome: Literal["committed", "failed", "aborted"]
    reason: str | None = None


class ProbeRequest(_Strict):
    """`POST /weights/verify`: the trainer's logprobs of a fixed token sequence,
    computed by its own forward pass right after pushing `version`."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    version: int = Field(description="The version just committed; must be the served one.")
    token_ids: list[int] = Field(min_length=2, max_length=4096)
    trainer_logprobs: list[float] = Field(
        description="logprob of token_ids[i] given token_ids[:i], for i = 1..len-1.")
    tolerance: float = Field(gt=0, description="Largest acceptable mean |dlogp|.")


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
    push_in_progress: bool
    connected: str | None = Field(description="Connection id of the data plane, if any.")
    data_plane_port: int
    transports: list[str]
    last_push: LastPush | None = None
    last_probe: ProbeResult | None = Field(
        None, description="The trainer's post-push probe of the latest version that ran one.")
    suspect: str | None = Field(
        None, description="Why the served version is suspect (its probe failed), else null.")
