"""The engine's settings: what vLLM is told (the model, its dtype and
quantization, its memory, its parallel layout over hosts, LoRA, a drafter)
and how its processes wait. `ServerSettings` (config.py) is these and the
server's own (HTTP, tokens, the weight routes and the data plane); the
fields read as they do there: `ROLLOUT_SIDECAR_*`, then `serve` flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

ServeDtype = Literal["auto", "bfloat16", "float16", "float32"]
# vLLM 0.32's online quantization of an unquantized checkpoint, by its names.
Quantization = Literal["fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
                       "int8_per_channel_weight_only"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


class EngineSettings(BaseModel):
    """The settings `serve` hands to vLLM's engine (engine/engine_config.py)."""

    model: str | None = Field(
        None, description="A local HF checkpoint dir or a Hugging Face hub id (resolved as "
        "vLLM does: HF_HOME cache, HF_HUB_OFFLINE honoured); unset serves the embedded default "
        "model."
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "rollout-sidecar",
        description="Where the embedded default model is built once.",
    )
    dtype: ServeDtype = Field(
        "bfloat16", description="Serving dtype; pushes are cast to it. Ours is bfloat16 where "
        "vLLM's is auto: RL trainers compute in bf16 mixed precision, and a checkpoint saved "
        "in fp32 would otherwise be served at twice the memory. float32 makes served logprobs "
        "reproduce a trainer's fp32 forward exactly.")
    quantization: Quantization | None = Field(
        None, description="Serve quantized, as vLLM's --quantization does to an unquantized "
        "checkpoint: every push is re-quantized by vLLM's layerwise reload exactly as a fresh "
        "load quantizes the same weights (docs/fast-rollouts.md). vLLM 0.32: the fp8 schemes "
        "need a GPU (fp8_per_block: or an AMX CPU); int8_per_channel_weight_only quantizes "
        "MoE experts only (linear layers stay in the serving dtype) and needs AMX on x86. "
        "Serving dtype bfloat16 or float16: vLLM quantizes online from those only.")
    speculative_config: str | None = Field(
        None, description="Speculative decoding, as vLLM's --speculative-config: a JSON "
        "object, e.g. {\"method\": \"draft_model\", \"model\": \"/ckpt/draft\", "
        "\"num_speculative_tokens\": 3}. A drafter with a checkpoint of its own (a local "
        "dir) takes pushes with the target, in the same commit; one a push leaves out is "
        "reported frozen (docs/fast-rollouts.md). vLLM 0.32 on CPU runs draft_model, ngram "
        "and the EAGLE family.")
    lm_head_fp32: bool = Field(
        False,
        description="Compute the lm_head's logits in float32 over the serving-dtype body "
        "(vLLM's head_dtype): removes most of the bf16 train/rollout logprob mismatch "
        "(ScaleRL, MiniMax-M1). Compute your trainer's head in fp32 too. Costs a cast of "
        "the head's weight per step on CPU; free on CUDA.",
    )
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="What sampled-token logprobs are (vLLM's logprobs_mode). "
        "raw_logprobs: log-softmax of the model's logits, the distribution a trainer's plain "
        "forward computes. processed_logprobs: log-softmax of the logits vLLM sampled from, "
        "after penalties, logit bias, bad words, temperature, min_p and top-k/top-p (tokens "
        "masked out are -inf); TRL's GRPO importance-sampling correction expects it (its "
        "forward divides the logits by the temperature). Prompt logprobs are raw in both.")
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + completion in tokens. Unset: the model's "
        "own (as vLLM), lowered only if the KV cache cannot hold one such sequence.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory for weights + KV cache. Unset, on a GPU: vLLM's "
        "0.9 less what a push needs outside it (2 GiB of receive and load scratch, plus the "
        "model with weight_staging=device), divided by the GPU's memory; lower it when the "
        "GPU is shared with a trainer. On CPU, given explicitly: the share of host memory "
        "vLLM-CPU reserves for its worker (the KV cache is that less the worker's RSS), "
        "unless kv_cache_gib or VLLM_CPU_KVCACHE_SPACE is set; unset, the KV cache is sized "
        "to the model (kv_cache_gib).",
    )
    kv_cache_gib: float | None = Field(
        None, gt=0, description="KV cache per worker, GiB (vLLM's kv_cache_memory_bytes); wins "
        "over VLLM_CPU_KVCACHE_SPACE (removed from the engine's environment) and, on a GPU, "
        "over gpu_memory_utilization's KV sizing. Unset, on CPU: VLLM_CPU_KVCACHE_SPACE if "
        "set, else vLLM's host share if gpu_memory_utilization is given, else sized to the "
        "model: 2 x layers x KV heads x head dim x dtype bytes per token, times "
        "min(max_num_seqs, 8) x max_model_len in whole blocks, capped at 0.3 of host memory "
        "(docs/deploy.md, \"KV cache on CPU\"). Unset, on a GPU: what "
        "gpu_memory_utilization leaves.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences batched at once (vLLM's "
                              "default on most GPUs).")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs (or CPU worker processes) one copy of the model is split "
        "over; every worker joins the weight data plane and loads its own shard of a push.")
    nnodes: int = Field(
        1, ge=1, description="Hosts one engine spans with vLLM's multiprocessing executor "
        "(vLLM's --nnodes): this server runs on the first (node_rank 0) and serves; every "
        "other host runs `serve --headless` with the same settings and its own node_rank "
        "(docs/deploy.md, \"Several hosts\").")
    node_rank: int = Field(0, ge=0, description="This host's rank among nnodes (vLLM's "
                           "--node-rank); 0 serves, the others run --headless.")
    master_addr: str = Field(
        "127.0.0.1", description="With nnodes > 1: node 0's address, reachable from every "
        "node (vLLM's --master-addr); the workers on other hosts also meet the data plane's "
        "store there.")
    master_port: int = Field(29501, ge=1, le=65535, description="With nnodes > 1: the port "
                             "torch.distributed meets on at master_addr (vLLM's "
                             "--master-port).")
    headless: bool = Field(
        False, description="Run only this host's workers of an engine served by node 0 "
        "(nnodes > 1, node_rank > 0): no HTTP, no API; exits when its workers do.")
    head_gone_s: float = Field(
        60.0, gt=0, description="With --headless: how long node 0 may not answer before this "
        "host's workers stop (exit 0), so that a supervisor restarts them against the next "
        "node 0. Long enough to ride out a network blip and a node 0 restart: a node 0 "
        "that answers again as a new engine (its store no longer holds this host's key) "
        "gets fresh workers from this host, which rejoins it (engine/headless.py).")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="vLLM's executor: mp (processes, one host or, with nnodes, "
        "several) or ray (a Ray cluster's actors, across hosts; extra `ray`). Unset: vLLM's "
        "choice.")
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graph capture and compilation. Unset: false on a GPU "
        "(CUDA graphs, as vLLM), true on CPU (a server starts in seconds, not after minutes "
        "of compilation).")
    seed: int = Field(0, description="Engine seed.")
    enable_lora: bool = Field(
        False, description="Accept LoRA adapter pushes (`WeightPusher.push(peft_model, v)` "
        "then sends the adapter, not the merged model): vLLM's LoRA layers wrap the model, "
        "which costs some decode speed, so it is off unless asked for.")
    max_lora_rank: int = Field(64, ge=1, le=512, description="The largest adapter rank "
                               "accepted (vLLM sizes its LoRA buffers for it).")
    lora_keep: int = Field(
        3, ge=1, le=64, description="Adapter versions kept loaded: requests admitted under "
        "an older version finish on its adapter while newer ones serve the newest.")
    engine_wait: Literal["nap", "spin"] = Field(
        "nap", description="CPU only: how vLLM's engine core and workers wait for their next "
        "message. nap: sleep ~0.1 ms between checks, which frees the GIL for the data plane "
        "and avoids the sched_yield loop that stalled a process on a core shared by two "
        "replicas; spin: vLLM's own loop for 1 s after each message, which hands its core "
        "over to a CPU-bound process pinned to it more readily. A GPU server always waits as "
        "vLLM does.")

    @field_validator("speculative_config")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from e
        if not isinstance(parsed, dict) or not ({"method", "model"} & parsed.keys()):
            raise ValueError("a JSON object naming at least `method` or `model`, as vLLM's "
                             "--speculative-config")
        return value

    @property
    def speculative(self) -> dict[str, Any] | None:
        """`speculative_config` parsed, as vLLM's engine args take it."""
        return json.loads(self.speculative_config) if self.speculative_config else None

    @field_validator("quantization", "speculative_config", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value  # compose passes an unset variable as ""

    @field_validator("quantization")
    @classmethod
    def _quantized_from_16_bits(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("dtype") == "float32":
            raise ValueError(f"{value} quantizes online from bfloat16 or float16 weights "
                             "(vLLM refuses float32): serve with --dtype bfloat16")
        return value
