"""vLLM's AsyncLLM in our process: start, stop, health, and what it serves.

`GenerationEngine` is the object the app keeps as `app.state.engine`. It owns
the engine's lifetime and the state every feature shares (the version gate,
the checkpoint index, the request tracker); the work on top of it lives with
its feature and is reached through it: /generate and scoring in
generate/service.py, response shaping in generate/response.py, request
tracking in engine/request_tracking.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_sidecar.client.protocol import GenerateRequest, GenerateResponse
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import kv_cache_size
from rollout_sidecar.server.engine.adapter_table import AdapterTable, lora_engine_args
from rollout_sidecar.server.engine.idle_wait import ENGINE_WAIT_ENV
from rollout_sidecar.server.engine.platform_defaults import resolve as resolve_defaults
from rollout_sidecar.server.engine.platform_defaults import split_bytes
from rollout_sidecar.server.engine.request_tracking import RequestTracker, Track, abort_quietly
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.generate.service import GenerateService
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.weights.worker.host_share import receivers, shares_host_staging

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
    workers: int = 1  # this server's ranks in the data-plane group (host_share.receivers)
    shared_staging: bool = False  # TP workers share one staged copy (host_share.py)
    logprobs_mode: str = "raw_logprobs"  # as vLLM's model config holds it


class GenerationEngine:
    def __init__(self, settings: ServerSettings, model_path: Path, metrics: ServerMetrics,
                 boot_id: str = "") -> None:
        self.settings = settings
        self.model_path = model_path
        self.metrics = metrics
        self.boot_id = boot_id
        self.index = CheckpointIndex.from_checkpoint(model_path)
        self.gate = VersionGate(0)
        # Which LoRA adapter each version serves with (None: the full weights alone).
        self.adapters = AdapterTable(settings, boot_id)
        self.tracker = RequestTracker(self.gate)
        self.generator = GenerateService(self)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.info: EngineInfo | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        width = 4 if s.dtype == "float32" else 2
        served_bytes = self.index.num_parameters * width
        split = split_bytes(t.numel * width for t in self.index.tensors.values())
        defaults = resolve_defaults(s, served_bytes, split)
        kv = kv_cache_size.choose(s.kv_cache_gib, s.gpu_memory_utilization, os.environ,
                                  defaults.cpu)
        if kv.drop_env:
            # vLLM-CPU would overwrite the setting with it (kv_cache_size.py); the
            # engine's processes inherit this environment, so they lose it too.
            log.warning("kv_cache_gib is set: ignoring %s=%s", kv_cache_size.KV_ENV,
                        os.environ.pop(kv_cache_size.KV_ENV))
        # The engine's processes inherit this environment (engine/idle_wait.py).
        os.environ[ENGINE_WAIT_ENV] = s.engine_wait
        args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=s.dtype,
            # -1: the model's own length, lowered by vLLM only if the KV cache
            # cannot hold one sequence of it (vLLM's auto-fit).
            max_model_len=s.max_model_len or -1,
            gpu_memory_utilization=defaults.gpu_memory_utilization,
            max_num_seqs=s.max_num_seqs,
            tensor_parallel_size=s.tensor_parallel_size,
            enforce_eager=defaults.enforce_eager,
            seed=s.seed,
            weight_transfer_config={"backend": WEIGHT_TRANSFER_BACKEND},
            # raw: the model's own distribution (before temperature/top-p), what a
            # trainer's plain forward computes; processed: the one sampled from.
            logprobs_mode=s.logprobs_mode,
            # vLLM computes the lm_head in head_dtype (casting the weight on the
            # fly, so a push needs nothing extra).
            hf_overrides={"head_dtype": "float32"} if s.lm_head_fp32 else {},
            kv_cache_memory_bytes=kv.explicit_bytes,
            **lora_engine_args(s),
        )
        # Resolved here rather than in from_engine_args: the sized default needs
        # the model's shape and max_model_len as vLLM resolves them.
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        kv_why = kv.why
        if kv.source == "sized":
            vllm_config.cache_config.kv_cache_memory_bytes, kv_why = kv_cache_size.size_for(
                vllm_config, s.max_num_seqs)
        log.info("engine defaults: %s; KV cache: %s", defaults.why, kv_why)
        self.llm = AsyncLLM.from_vllm_config(
            vllm_config, stat_loggers=[self.metrics.stat_logger_factory()]
        )
        # The label vLLM stamps on every step's outputs (engine/version_spans.py):
        # ours from the first token, never vLLM's "default".
        await self.llm.update_weight_version(str(self.gate.version))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        mc = self.llm.model_config
        pc = self.llm.vllm_config.parallel_config
        shared = shares_host_staging(pc, s)
        self.info = EngineInfo(
            model=str(self.model_path),
            dtype=str(mc.dtype).removeprefix("torch."),
            lm_head_dtype=str(mc.head_dtype).removeprefix("torch."),
            max_model_len=mc.max_model_len,
            vocab_size=mc.get_vocab_size(),
            workers=receivers(pc, shared), shared_staging=shared,
            logprobs_mode=mc.logprobs_mode,
        )

    async def check_health(self) -> None:
        await self.llm.check_health()

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------ what the routes call

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """POST /generate (generate/service.py)."""
        return await self.generator.generate(req)

    async def score(self, token_ids: list[int], version: int) -> list[float]:
        """Prompt logprobs of `token_ids` under `version`, for /weights/probe."""
        return await self.generator.score(token_ids, version)

    def watch(self, collector: Any) -> Track:
        """Track a request submitted outside `generate` (the /v1 routes,
        openai_api/compat.py), so that `freeze_finished` sees it too."""
        return self.tracker.watch(collector)

    def unwatch(self, track: Track) -> None:
        self.tracker.unwatch(track)

    def freeze_finished(self) -> None:
        """Called by a commit just before it publishes (request_tracking.py)."""
        self.tracker.freeze_finished()

    async def restart_lagging(self, version: int) -> None:
        """Called by a `keep` commit once it published `version`, the engine
        still paused: every run that would leave a token further behind than
        its request's `max_version_lag` is aborted, and its request submits it
        again on these weights (generate/service.py)."""
        behind = self.tracker.too_far_behind(version)
        if behind:
            self.metrics.lag_restarts.inc(len(behind))
            # A run the abort misses ends on its own; its request drops it all the same.
            await abort_quietly(self.llm.abort([t.collector.request_id for t in behind],
                                               internal=True))
