"""What the rest of the server may ask of the engine: a typed interface.

Every feature on top of the engine (generate/, openai_api/, weights/,
health/) is written against `Engine`, never against `GenerationEngine`
itself, so imports run one way (engine <- generate, engine <- weights) and a
unit test's fake implements this protocol instead of production code
branching for it. `Scorer` is the one thing the weight probe needs from
generate/: prompt logprobs under a version (generate/service.py implements
it; app.py hands it to weights/).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.engine.adapter_table import AdapterTable
    from rollout_sidecar.server.engine.drafter import Drafter
    from rollout_sidecar.server.engine.lifecycle import EngineInfo
    from rollout_sidecar.server.engine.request_tracking import RequestTracker, Track
    from rollout_sidecar.server.engine.version_gate import VersionGate
    from rollout_sidecar.server.engine.vllm_surface import Collector, VllmEngine
    from rollout_sidecar.server.metrics.collectors import ServerMetrics
    from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex


class Engine(Protocol):
    """vLLM's AsyncLLM in this process and the state every feature shares."""

    settings: ServerSettings
    model_path: Path
    metrics: ServerMetrics
    boot_id: str
    index: CheckpointIndex
    gate: VersionGate
    adapters: AdapterTable
    drafter: Drafter | None  # serve --speculative-config
    tracker: RequestTracker
    llm: VllmEngine | None  # vLLM's AsyncLLM once started (engine/vllm_surface.py)
    tokenizer: PreTrainedTokenizerBase | None
    info: EngineInfo | None

    async def start(self) -> None: ...
    def running(self) -> VllmEngine:
        """vLLM's engine; raises if it is not started (or shut down)."""
        ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...
    def watch(self, collector: Collector) -> Track: ...
    def unwatch(self, track: Track) -> None: ...
    def freeze_finished(self) -> None: ...
    async def restart_lagging(self, version: int) -> None: ...


class Scorer(Protocol):
    """Prompt logprobs of `token_ids` under `version` (the weight probe's)."""

    async def score(self, token_ids: list[int], version: int) -> list[float]: ...
