"""vLLM general plugin: registers our weight-transfer backend.

vLLM calls this in every process it spawns (the engine core and its workers)
before the model loads; registering only in the API process is not enough.
"""

from __future__ import annotations

BACKEND = "rollout_sidecar"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # Plugins may be loaded more than once per process.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollout_sidecar.server.weights.worker_engine", "StagedWeightTransferEngine"
        )
