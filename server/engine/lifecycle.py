"""vLLM's AsyncLLM in our process, and the /generate logic on top of it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_sidecar.client.protocol import (
    GenerateRequest,
    GenerateResponse,
    PromptResult,
    Sample,
    SamplingConfig,
    Usage,
)
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.generate import request_checks
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex

log = logging.getLogger(__name__)

# Registered by our vLLM general plugin in every worker process.
WEIGHT_TRANSFER_BACKEND = "rollout_sidecar"


@dataclass
class EngineInfo:
    model: str
    dtype: str
    lm_head_dtype: str
    max_model_len: int
    vocab_size: int
    workers: int = 1  # TP x PP x DP: this server's ranks in the data-plane group


@dataclass(eq=False)
class _Track:
    """One submitted prompt: its output queue, and the version it finished on."""

    collector: Any
    finish_version: int | None = None


async def _shielded(coro: Any) -> None:
    # An abort must reach the engine even while our own task is being cancelled.
    with contextlib.suppress(Exception):
        await asyncio.shield(coro)


class GenerationEngine:
    def __init__(self, settings: ServerSettings, model_path: Path, metrics: ServerMetrics,
                 boot_id: str = "") -> None:
        self.settings = settings
        self.model_path = model_path
        self.metrics = metrics
        self.boot_id = boot_id
        self.index = CheckpointIndex.from_checkpoint(model_path)
        self.gate = VersionGate(0)
        self._tracks: set[_Track] = set()
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
            # -1: the model's own length, lowered by vLLM only if the KV cache
            # cannot hold one sequence of it (vLLM's auto-fit).
            max_model_len=s.max_model_len or -1,
            gpu_memory_utilization=s.gpu_memory_utilization,
            max_num_seqs=s.max_num_seqs,
            tensor_parallel_size=s.tensor_parallel_size,
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
            workers=self.llm.vllm_config.parallel_config.world_size_across_dp,
        )

    async def check_health(self) -> None:
        await self.llm.check_health()

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ generate

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """Run one request's prompts; its tag is the version that produced its
        tokens (see version_gate.py for how commits are ordered against it)."""
        assert self.info is not None
        request_checks.check_request(req, self.settings)
        prompt_ids = await request_checks.prompt_token_ids(
            req, self.tokenizer, self.info.max_model_len, self.info.vocab_size,
            self.settings.max_prompt_bytes or 32 * self.info.max_model_len)
        params = [request_checks.sampling_params(req, i) for i in range(len(prompt_ids))]
        lease = await self.gate.admit(req.min_weight_version, self.settings.min_version_wait_s)
        tracks: list[_Track] = []
        try:
            try:  # all prompts enter the engine at once, so it batches them
                request_id = uuid.uuid4().hex
                for i, ids in enumerate(prompt_ids):
                    tracks.append(_Track(await self._submit(ids, params[i], f"{request_id}-{i}")))
            finally:
                lease.submitted()
            self._tracks.update(tracks)
            outputs = await asyncio.gather(*[self._final(t) for t in tracks])
        except BaseException:  # cancelled (client gone) or failed: free the engine
            # The collectors hold vLLM's internal ids (it suffixes ours).
            await _shielded(self.llm.abort([t.collector.request_id for t in tracks
                                            if t.finish_version is None], internal=True))
            raise
        finally:
            self._tracks.difference_update(tracks)
            lease.finished()
        return self._response(req, lease.version, prompt_ids, outputs, tracks)

    async def _submit(self, ids: list[int], params: Any, request_id: str) -> Any:
        from vllm.exceptions import VLLMError
        from vllm.inputs import TokensPrompt

        try:
            return await self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=ids),
                                              params)
        except VLLMError as e:
            raise request_checks.as_bad_request(e) from e

    async def _final(self, track: _Track) -> Any:
        q = track.collector
        while True:
            out = q.get_nowait() or await q.get()
            if out.finished:
                if track.finish_version is None:
                    track.finish_version = self.gate.version
                return out

    def watch(self, collector: Any) -> _Track:
        """Track a request submitted outside `generate` (the /v1 routes,
        openai_compat.py), so that `freeze_finished` sees it too."""
        track = _Track(collector)
        self._tracks.add(track)
        return track

    def unwatch(self, track: _Track) -> None:
        self._tracks.discard(track)

    def freeze_finished(self) -> None:
        """Called by a commit just before it publishes: requests whose final
        output already waits in their queue finished on the current version,
        however late their coroutine reads it."""
        for t in self._tracks:
            pending = getattr(t.collector, "output", None)
            if t.finish_version is None and pending is not None and pending.finished:
                t.finish_version = self.gate.version

    def _response(self, req: GenerateRequest, start: int, prompt_ids: list[list[int]],
                  outputs: list[Any], tracks: list[_Track]) -> GenerateResponse:
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
        end = max((t.finish_version or start) for t in tracks)
        versions = self.gate.versions_between(start, end)
        return GenerateResponse(
            results=results, weight_version=start, weight_versions=versions,
            weight_suspect=any(v in self.gate.suspect for v in versions),
            boot_id=self.boot_id,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
        )

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
