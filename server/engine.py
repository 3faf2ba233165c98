"""vLLM's AsyncLLM in our process, and the /generate logic on top of it."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_sidecar.client.schema import (
    GenerateRequest,
    GenerateResponse,
    PromptResult,
    Sample,
    SamplingConfig,
    Usage,
)
from rollout_sidecar.server.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.metrics import ServerMetrics
from rollout_sidecar.server.version_gate import VersionGate

log = logging.getLogger(__name__)

# Registered by our vLLM general plugin in every worker process.
WEIGHT_TRANSFER_BACKEND = "rollout_sidecar"


class BadRequest(ValueError):
    """A request the engine cannot serve; answered with 400 naming the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class EngineInfo:
    model: str
    dtype: str
    lm_head_dtype: str
    max_model_len: int
    vocab_size: int


class GenerationEngine:
    def __init__(self, settings: ServerSettings, model_path: Path, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.model_path = model_path
        self.metrics = metrics
        self.index = CheckpointIndex.from_checkpoint(model_path)
        self.gate = VersionGate(0)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.info: EngineInfo | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
            max_num_seqs=s.max_num_seqs,
            enforce_eager=s.enforce_eager,
            seed=s.seed,
            weight_transfer_config={"backend": WEIGHT_TRANSFER_BACKEND},
            # Logprobs of the model's own distribution (before temperature/top-p),
            # which is what a trainer's forward pass computes for the importance ratio.
            logprobs_mode="raw_logprobs",
            # vLLM computes the lm_head in head_dtype (casting the weight on the
            # fly, so a push needs nothing extra).
            hf_overrides={"head_dtype": "float32"} if s.lm_head_fp32 else {},
        )
        self.llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[self.metrics.stat_logger_factory()]
        )
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        mc = self.llm.model_config
        self.info = EngineInfo(
            model=str(self.model_path),
            dtype=str(mc.dtype).removeprefix("torch."),
            lm_head_dtype=str(mc.head_dtype).removeprefix("torch."),
            max_model_len=mc.max_model_len,
            vocab_size=mc.get_vocab_size(),
        )

    async def check_health(self) -> None:
        await self.llm.check_health()

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ generate

    def _prompt_ids(self, req: GenerateRequest) -> list[list[int]]:
        assert self.info is not None
        if req.prompts is not None:
            ids = [self.tokenizer(p).input_ids for p in req.prompts]
            field = "prompts"
        else:
            ids = req.prompt_token_ids or []
            field = "prompt_token_ids"
        for i, p in enumerate(ids):
            if len(p) == 0:
                raise BadRequest(f"{field}[{i}] is empty after tokenization", f"{field}[{i}]")
            if len(p) >= self.info.max_model_len:
                raise BadRequest(
                    f"{field}[{i}] has {len(p)} tokens; max_model_len is "
                    f"{self.info.max_model_len} (prompt plus at least one new token)",
                    f"{field}[{i}]",
                )
            bad = [t for t in p if not 0 <= t < self.info.vocab_size]
            if bad:
                raise BadRequest(
                    f"{field}[{i}] has token id {bad[0]} outside the vocabulary "
                    f"[0, {self.info.vocab_size})", f"{field}[{i}]",
                )
        return ids

    def _sampling_params(self, req: GenerateRequest, prompt_index: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        # One seed per prompt: the same request replays exactly, yet prompts of
        # one request do not share their random draws.
        seed = None if s.seed is None else (s.seed + prompt_index * 1_000_003) % (2**63)
        try:
            return SamplingParams(
                n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k, seed=seed, stop=s.stop or None,
                logprobs=0 if s.logprobs else None,
                prompt_logprobs=0 if s.prompt_logprobs else None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:  # vLLM's own range checks
            raise BadRequest(str(e), "sampling") from e

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        if (err := req.sampling.range_error()) is not None:
            raise BadRequest(err[1], err[0])
        if req.min_weight_version is not None and req.min_weight_version < 0:
            raise BadRequest("min_weight_version must be >= 0", "min_weight_version")
        prompt_ids = self._prompt_ids(req)
        params = [self._sampling_params(req, i) for i in range(len(prompt_ids))]
        start_version = await self.gate.admit(
            req.min_weight_version, self.settings.min_version_wait_s
        )
        request_id = uuid.uuid4().hex
        # All prompts go to the engine at once so it batches them continuously.
        outputs = await asyncio.gather(*[
            self._one(ids, params[i], f"{request_id}-{i}") for i, ids in enumerate(prompt_ids)
        ])
        end_version = self.gate.version
        results, prompt_tokens, completion_tokens = [], 0, 0
        for ids, out in zip(prompt_ids, outputs, strict=True):
            samples = [self._sample(c, req.sampling.logprobs) for c in out.outputs]
            prompt_tokens += len(ids)
            completion_tokens += sum(len(s.token_ids) for s in samples)
            results.append(PromptResult(
                prompt_token_ids=list(ids), samples=samples,
                prompt_logprobs=self._prompt_logprobs(ids, out.prompt_logprobs)
                if req.sampling.prompt_logprobs else None))
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generated_tokens.inc(completion_tokens)
        versions = self.gate.versions_between(start_version, end_version)
        return GenerateResponse(
            results=results,
            weight_version=start_version,
            weight_versions=versions,
            weight_suspect=any(v in self.gate.suspect for v in versions),
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
        )

    async def _one(self, ids: list[int], params: Any, request_id: str) -> Any:
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                           request_id):
            final = out
        assert final is not None
        return final

    async def score(self, token_ids: list[int], version: int) -> list[float]:
        """logprob of token i given tokens < i (i >= 1) under `version`, which
        must still be the served one when the prefill ran."""
        r = await self.generate(GenerateRequest(
            prompt_token_ids=[token_ids], min_weight_version=version,
            sampling=SamplingConfig(max_tokens=1, logprobs=False, prompt_logprobs=True)))
        if r.weight_versions != [version]:
            raise BadRequest(f"version {version} is no longer served (now "
                             f"{r.weight_versions})", "version")
        lps = r.results[0].prompt_logprobs or []
        return [float("nan") if lp is None else lp for lp in lps[1:]]

    @staticmethod
    def _prompt_logprobs(ids: list[int], plps: Any) -> list[float | None]:
        # vLLM: one dict per position (None for the first), keyed by token id.
        return [None if d is None else float(d[t].logprob) for t, d in zip(ids, plps,
                                                                             strict=True)]

    @staticmethod
    def _sample(c: Any, want_logprobs: bool) -> Sample:
        token_ids = list(c.token_ids)
        logprobs = None
        if want_logprobs:
            logprobs = [float(step[t].logprob) for t, step in zip(token_ids, c.logprobs,
                                                                  strict=True)]
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        return Sample(text=c.text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason)
