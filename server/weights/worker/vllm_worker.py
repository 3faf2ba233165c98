"""vLLM's worker as our worker method sees it (worker_calls.py): the other
side of `collective_rpc`, typed as server/engine/vllm_surface.py types the
engine's side, and read against vLLM's source by tests/vllm_api the same
way (`STANDS_FOR`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rollout_sidecar.server.engine.vllm_surface import ParallelConfigView

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.worker.transfer_engine import (
        StagedWeightTransferEngine,
    )
    from rollout_sidecar.server.weights.worker_requests import Request


class VllmWorker(Protocol):
    """vLLM's Worker, as our worker method (worker_calls.py) sees it."""

    rank: int
    parallel_config: ParallelConfigView
    weight_transfer_engine: StagedWeightTransferEngine | None

    def start_weight_update(self) -> None: ...
    # vLLM types it a dict; it hands it to our engine's `update_weights` as it is.
    def update_weights(self, update_info: Request) -> None: ...
    def finish_weight_update(self) -> None: ...


STANDS_FOR: dict[type, str] = {VllmWorker: "vllm.v1.worker.gpu_worker.Worker"}
