"""How much memory the KV cache gets, and who decided.

Why this exists: vLLM-CPU, left alone, sizes its KV cache as a share of the
host's memory (`gpu_memory_utilization` x host memory, less the worker's own
RSS: `vllm/v1/worker/cpu_worker.py:73-94, 233-250`) and fills it with zeros at
start (`vllm/v1/worker/utils.py:596`, `torch.zeros`), so every byte of it is
resident. At our old default of 0.3 that was ~6 GiB of KV for a 2M-parameter
model on a 24 GB host, and three servers on one machine got one OOM-killed.

What governs it in vLLM 0.32 (CPU), first match wins:

1. `cache_config.kv_cache_memory_bytes` (`--kv-cache-memory-bytes`), which the
   CPU platform overwrites with `VLLM_CPU_KVCACHE_SPACE` GiB when that is set
   (`vllm/platforms/cpu.py:323-327`, integer GiB only);
2. else `gpu_memory_utilization` x the NUMA node's memory, less the worker's
   RSS after a warm-up forward (`cpu_worker.py:73-94`, `:233-250`).

With an explicit size vLLM also skips that warm-up in eager mode
(`cpu_worker.py:190-202`), which starts the server sooner.

Our precedence (`choose`), first match wins:

1. `kv_cache_gib` (`--kv-cache-gib`): ours and the most specific; it wins over
   a `VLLM_CPU_KVCACHE_SPACE` inherited from an image or a chart (the engine
   start removes that variable from its environment, logged), and applies on a
   GPU too (vLLM's `kv_cache_memory_bytes`, which replaces
   `gpu_memory_utilization`'s KV sizing there);
2. on a GPU: vLLM's `gpu_memory_utilization` (platform_defaults.py);
3. `VLLM_CPU_KVCACHE_SPACE` in the environment: honoured as vLLM does;
4. `gpu_memory_utilization` given explicitly: vLLM-CPU's share of host memory,
   the legacy behaviour, kept for whoever asks for it;
5. otherwise sized to the model (`sized_bytes`): `max_num_seqs` sequences all
   `max_model_len` long, but at most `CPU_FULL_SEQS` of them, in whole blocks,
   plus vLLM's null block; capped at `CPU_HOST_SHARE` of the host's memory
   (never more than the old default reserved).

Why at most `CPU_FULL_SEQS` full-length sequences, not all `max_num_seqs`:
the KV cache is tokens, not sequences. vLLM's scheduler admits sequences
while their blocks fit and preempts (recomputes) one under pressure, so 256
short rollouts batch together in the room of 8 long ones; only many
sequences at full length at once feel the limit. Reserving the worst case
instead cost 1.5 GiB of resident zeros for the 2M-parameter default model
(256 x 2048 tokens), which held the server at 3.4 GiB; 8 full sequences keep
the whole process tree under 2 GiB (bench/server_footprint.py).

Bytes per token: 2 (K and V) x layers x KV heads per worker x head size x
the KV dtype's width; MLA models store one latent per layer (no factor 2, one
"head" of kv_lora_rank + rope dims: vLLM's `get_head_size`/`get_num_kv_heads`).
Sliding-window layers are counted as full ones: an overestimate, never short.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
GIB = 2**30
CPU_HOST_SHARE = 0.3  # cap of the sized default: what the old default reserved in all
NULL_BLOCKS = 1  # vLLM keeps block 0 as its null block
CPU_FULL_SEQS = 8  # full-length sequences the sized default holds at once (docstring)

Source = Literal["setting", "gpu", "env", "host_share", "sized"]


@dataclass(frozen=True)
class KvChoice:
    source: Source
    explicit_bytes: int | None  # for the engine args; None: vLLM decides, or sized later
    drop_env: bool  # remove VLLM_CPU_KVCACHE_SPACE first: it would override the setting
    why: str


def env_gib(env: Mapping[str, str]) -> str | None:
    """`VLLM_CPU_KVCACHE_SPACE` as vLLM reads it: set and not empty."""
    value = env.get(KV_ENV, "")
    return value or None


def choose(kv_cache_gib: float | None, gpu_memory_utilization: float | None,
           env: Mapping[str, str], on_cpu: bool) -> KvChoice:
    """Which rule sizes the KV cache (module docstring, "Our precedence")."""
    if kv_cache_gib is not None:
        overridden = env_gib(env) if on_cpu else None
        return KvChoice("setting", math.ceil(kv_cache_gib * GIB), env_gib(env) is not None,
                        f"kv_cache_gib {kv_cache_gib:g} GiB (set)"
                        + (f", over {KV_ENV}={overridden}" if overridden else ""))
    if not on_cpu:
        return KvChoice("gpu", None, False, "what gpu_memory_utilization leaves (vLLM)")
    if (value := env_gib(env)) is not None:
        return KvChoice("env", None, False, f"{KV_ENV}={value} GiB (environment)")
    if gpu_memory_utilization is not None:
        return KvChoice("host_share", None, False,
                        f"gpu_memory_utilization {gpu_memory_utilization:g} of host memory "
                        "(set), less the worker's RSS (vLLM-CPU)")
    return KvChoice("sized", None, False, "sized to the model")


def bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int,
                    mla: bool = False) -> int:
    """KV bytes one token takes in one worker (module docstring)."""
    return (1 if mla else 2) * num_layers * num_kv_heads * head_size * dtype_bytes


def sized_bytes(per_token: int, max_num_seqs: int, max_model_len: int, block_size: int,
                cap_bytes: int, full_seqs: int = CPU_FULL_SEQS) -> tuple[int, int]:
    """(KV bytes for min(`max_num_seqs`, `full_seqs`) full-length sequences in
    whole blocks plus the null block, that capped at `cap_bytes`)."""
    seqs = min(max_num_seqs, full_seqs)
    blocks = seqs * math.ceil(max_model_len / block_size) + NULL_BLOCKS
    need = blocks * block_size * per_token
    return need, min(need, cap_bytes)


def host_memory_bytes() -> int:
    """This host's memory, or the cgroup's limit (a container) if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max",  # cgroup v2; "max" when unlimited
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v1
        with contextlib.suppress(OSError, ValueError):
            total = min(total, int(Path(limit).read_text().strip()))
    return total


def model_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Per-worker KV bytes per token of the model a resolved `VllmConfig` serves."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc)
    return bytes_per_token(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(),
                           dtype.itemsize, mla=mc.use_mla)


def size_for(vllm_config: VllmConfig, max_num_seqs: int, host_bytes: int | None = None
             ) -> tuple[int, str]:
    """The sized default for a resolved `VllmConfig`: (bytes, why)."""
    per_token = model_bytes_per_token(vllm_config)
    max_len = vllm_config.model_config.max_model_len
    block = vllm_config.cache_config.block_size
    host = host_memory_bytes() if host_bytes is None else host_bytes
    need, got = sized_bytes(per_token, max_num_seqs, max_len, block, int(host * CPU_HOST_SHARE))
    seqs = min(max_num_seqs, CPU_FULL_SEQS)
    why = (f"{got / GIB:.3f} GiB sized to the model: {per_token} B/token x {seqs} "
           f"full-length seqs x {max_len} tokens (blocks of {block}, + null block; "
           f"max_num_seqs {max_num_seqs} shorter ones batch in the same room)")
    if got < need:
        why += (f"; the {need / GIB:.1f} GiB it needs is capped at {CPU_HOST_SHARE:g} of "
                f"{host / GIB:.0f} GiB host memory (vLLM preempts past it: set --kv-cache-gib "
                "or lower --max-num-seqs / --max-model-len)")
    return got, why
