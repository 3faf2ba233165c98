"""vLLM's AsyncLLM in our process: start, stop, health, and what it serves.

`GenerationEngine` is the object the app keeps as its `Services.engine`. It owns
the engine's lifetime and the state every feature shares (the version gate,
the checkpoint index, the request tracker), and implements `Engine`
(engine_api.py), the interface every feature is written against. The work on
top of it lives with its feature, which imports the engine and never the
other way: /generate and scoring in generate/service.py (built by app.py),
response shaping in generate/response.py, request tracking in
engine/request_tracking.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import engine_config
from rollout_sidecar.server.engine.adapter_table import AdapterTable
from rollout_sidecar.server.engine.drafter import Drafter, draft_index
from rollout_sidecar.server.engine.request_tracking import RequestTracker, Track, abort_quietly
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout_sidecar.server.engine.vllm_surface import Collector, VllmEngine

log = logging.getLogger(__name__)


@dataclass
class EngineInfo:
    model: str
    dtype: str
    lm_head_dtype: str
    max_model_len: int
    vocab_size: int
    logprobs_mode: str = "raw_logprobs"  # as vLLM's model config holds it
    quantization: str | None = None  # vLLM's online scheme, or None


class GenerationEngine:
    def __init__(self, settings: ServerSettings, model_path: Path, metrics: ServerMetrics,
                 boot_id: str = "") -> None:
        self.settings = settings
        self.model_path = model_path
        self.metrics = metrics
        self.boot_id = boot_id
        speculative = settings.speculative
        self.index = CheckpointIndex.from_checkpoint(model_path).with_draft(
            draft_index(speculative))
        self.drafter = Drafter(speculative, self.index, metrics.acceptance) \
            if speculative else None
        self.gate = VersionGate(0)
        # Which LoRA adapter each version serves with (None: the full weights alone).
        self.adapters = AdapterTable(settings, boot_id)
        self.tracker = RequestTracker(self.gate)
        self.llm: VllmEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.info: EngineInfo | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        config = engine_config.build(self.settings, self.model_path, self.index)
        log.info("engine defaults: %s", config.why)
        llm: VllmEngine = AsyncLLM.from_vllm_config(
            config.vllm_config, stat_loggers=[self.metrics.stat_logger_factory()]
        )
        self.llm = llm
        # The label vLLM stamps on every step's outputs (engine/version_spans.py):
        # ours from the first token, never vLLM's "default".
        await llm.update_weight_version(str(self.gate.version))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        mc = llm.model_config
        self.info = EngineInfo(
            model=str(self.model_path),
            dtype=str(mc.dtype).removeprefix("torch."),
            lm_head_dtype=str(mc.head_dtype).removeprefix("torch."),
            max_model_len=mc.max_model_len,
            vocab_size=mc.get_vocab_size(),
            logprobs_mode=mc.logprobs_mode,
            quantization=mc.quantization,
        )

    def running(self) -> VllmEngine:
        if self.llm is None:
            raise RuntimeError("the engine is not started (or was shut down)")
        return self.llm

    async def check_health(self) -> None:
        await self.running().check_health()

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------ what the routes call

    def watch(self, collector: Collector) -> Track:
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
            await abort_quietly(self.running().abort(
                [t.collector.request_id for t in behind], internal=True))
