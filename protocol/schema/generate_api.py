"""Wire types of the generation API: POST /generate, GET /info, /health,
/ready, and the error body every route answers with (pydantic only)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_sidecar.protocol.schema.drafter_api import DrafterStatus
from rollout_sidecar.protocol.schema.fields import (
    Bool,
    CommitPolicy,
    FinishReason,
    Float,
    Int,
    NonNegative,
    ReplyModel,
    StrictModel,
    TokenIds,
    not_null,
)


def _range(**bounds: object) -> dict:
    # In the OpenAPI schema, but checked by `range_error`, so that an
    # out-of-range value is a 400 naming the field rather than a 422.
    return {"json_schema_extra": bounds}


class SamplingConfig(StrictModel):
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


class GenerateRequest(StrictModel):
    """`POST /generate`: give exactly one of `prompts` or `prompt_token_ids`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompts"]}, {"required": ["prompt_token_ids"]}]})

    prompts: list[str] | None = Field(None, min_length=1, json_schema_extra=not_null)
    prompt_token_ids: list[TokenIds] | None = Field(None, min_length=1,
                                                    json_schema_extra=not_null)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    min_weight_version: Int | None = Field(
        None,
        description="Wait (bounded) until the server holds at least this weight version.",
    )
    max_version_lag: NonNegative | None = Field(
        None,
        description="While the request runs, none of its tokens is more than this many "
        "versions behind the newest committed one. Only a commit with policy 'keep' lets "
        "a request run across a commit: one that would leave a prompt's oldest token "
        "further behind restarts that prompt from scratch on the new weights (its tokens "
        "so far are dropped; see results[i].restarts). 0: every token of a sample from "
        "one version.")

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


class VersionSpan(ReplyModel):
    """Generated tokens `[start, end)` were sampled from the logits of weight
    version `version` (vLLM's and SGLang's shape, with an integer version)."""

    version: int
    start: int
    end: int
    resumed: bool = Field(
        False, description="This span began with its version prefilling the prompt and "
        "every token before `start` again, so its tokens attend to a KV cache this version "
        "alone built. True for every span after the first: at a `keep` commit the engine "
        "recomputes the cache of each running request on the new weights.")


class Sample(ReplyModel):
    """One sampled continuation."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = Field(
        None, description="Logprob of each sampled token under the serving weights: raw "
        "(before temperature/top-p) unless the server runs logprobs_mode processed_logprobs "
        "(GET /info says which). Non-finite values are the strings 'NaN', "
        "'Infinity', '-Infinity'; the client parses them into floats."
    )
    finish_reason: FinishReason
    weight_versions: list[VersionSpan] | None = Field(
        None, description="Which weights sampled each token: half-open, contiguous spans "
        "over token_ids, in order (one span unless a commit with policy 'keep' ran under "
        "the request). Token j's version computed the logits it was sampled from, over a KV "
        "cache built by that same version (a keep commit re-prefills). [] when no token "
        "was sampled; null when the server cannot tell (a server older than this field)."
    )

    def token_versions(self) -> list[int] | None:
        """The version of each token in `token_ids` (None without spans)."""
        if self.weight_versions is None:
            return None
        return [s.version for s in self.weight_versions for _ in range(s.start, s.end)]


class PromptResult(ReplyModel):
    prompt_token_ids: list[int]
    samples: list[Sample]
    restarts: int = Field(0, description="How many times a commit restarted this prompt "
                          "from scratch to keep to max_version_lag (its tokens then dropped).")
    prompt_logprobs: list[float | None] | None = Field(
        None, description="With sampling.prompt_logprobs: the logprob of each prompt token "
        "given the ones before it; the first is null (nothing precedes it)."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(ReplyModel):
    results: list[PromptResult]
    weight_version: int = Field(description="The version the request was admitted under: "
                                "every token's, unless a commit with policy 'keep' ran "
                                "under it (then see each sample's weight_versions).")
    versions_used: list[int] = Field(
        default_factory=list, description="Every version that produced a token of this "
        "response, ascending; more than one only with commit policy 'keep'.")
    weight_suspect: bool = Field(
        False, description="True if the trainer's post-push probe found one of "
        "versions_used serving logprobs beyond tolerance from its own forward pass "
        "(see /weights/status). Such tokens are not from the trained policy."
    )
    boot_id: str = Field("", description="The server process's boot id (see /weights/status).")
    usage: Usage
    # Filled by rollout_sidecar's client after the answer arrives; the server
    # never sends them. A try that did not answer is given up whole (nothing it
    # generated reaches the caller), so every span of every sample comes from
    # `replica`, and a version number means the same weights on every replica
    # (the all-or-nothing commit): a loop needs no other bookkeeping.
    replica: str | None = Field(
        None, description="Set by the client, never by the server: the replica URL that "
        "answered. Every sample and span of this response comes from it.")
    retried: list[str] = Field(
        default_factory=list, description="Set by the client: each earlier try that did not "
        "answer, in order, as 'url: what happened'. Empty when the first try answered; "
        "nothing a retried try generated is in this response.")


# ------------------------------------------------------------------ status


class InfoResponse(BaseModel):
    model: str
    dtype: str
    lm_head_dtype: str = Field(description="dtype the lm_head's logits are computed in.")
    quantization: str | None = Field(
        None, description="vLLM's online quantization scheme the server serves in "
        "(`serve --quantization`), or null: served in `dtype`.")
    drafter: DrafterStatus | None = Field(
        None, description="The speculative drafter (`serve --speculative-config`): whether "
        "it is synced with the served weights, and its acceptance since the last commit.")
    max_model_len: int
    vocab_size: int
    weight_version: int
    boot_id: str
    num_parameters: int
    commit_policy: CommitPolicy
    transports: list[str]
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs", description="What `Sample.logprobs` (and /v1 logprobs) are, as vLLM "
        "0.32 computes them. raw_logprobs: log-softmax of the model's logits, what a plain "
        "forward computes. processed_logprobs: log-softmax of the logits each token was "
        "sampled from, after penalties (repetition, frequency, presence), logit bias, bad "
        "words, min_tokens, temperature, min_p and top-k/top-p (masked tokens -inf); at "
        "temperature 0 everything but the temperature. TRL's GRPO compares them with its "
        "log-softmax(logits / temperature): it needs processed_logprobs, or temperature 1 "
        "with no top-k/top-p/penalties. Prompt logprobs are raw in both modes.")


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

