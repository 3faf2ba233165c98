"""The engine settings whose right default depends on the platform.

CPU (vLLM-CPU): eager mode, because compiling takes minutes and CUDA graphs
do not exist there. The KV cache is sized to the model unless something says
otherwise (kv_cache_size.py), and vLLM then ignores `gpu_memory_utilization`;
it is still passed as 0.3, which only counts where vLLM sizes the cache itself
(it reads it as the share of host memory to reserve,
`vllm/v1/worker/cpu_worker.py:73-94`: vLLM's 0.9 would take most of it).

GPU: CUDA graphs on (vLLM's own default: decoding is several times faster),
and `gpu_memory_utilization` as large as what a push needs outside vLLM's
budget allows (docs/gpu.md, "Memory a push needs"):

    budget = VLLM_DEFAULT - (device_staging + push_scratch) / gpu_total

- device_staging: with `weight_staging=device`, every TP worker stages the
  whole unsharded push in its GPU's memory: the model's bytes in the serving
  dtype, plus the buffers a bucket holding a chunk arrives in before its
  slots land in place (worker/placed_tensors.py): two buckets for a
  broadcast or one sender (`RECEIVE_BYTES`, at the trainer's default 256
  MiB buckets); each further trainer rank sending adds up to two of its
  share's buckets. A load copies nothing more (a split tensor used to be
  reassembled there: 2 GiB for an untied 128k-vocabulary 8B model). With
  host staging (the default), nothing.
- push_scratch: one bucket-sized receive buffer on the device, plus the
  layer a load materialises at once; `PUSH_SCRATCH_BYTES` covers buckets up
  to 1 GiB and layers up to 1 GiB (a 70B model's MLP is 0.9 GiB in bf16).

Asked of vLLM's platform, after vLLM is imported: on CUDA it reads the
device's memory through NVML, without initialising CUDA in this process.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sidecar.server.config import ServerSettings

VLLM_DEFAULT_UTILIZATION = 0.9
CPU_UTILIZATION = 0.3  # of host memory, on vLLM-CPU (module docstring)
PUSH_SCRATCH_BYTES = 2 << 30
# WeightPusher's default bucket_mb (trainer/push_config.py): tensors larger are split.
DEFAULT_BUCKET_BYTES = 256 << 20
RECEIVE_BYTES = 2 * DEFAULT_BUCKET_BYTES  # a scattered bucket's lent buffers (docstring)
MIN_UTILIZATION = 0.1


@dataclass(frozen=True)
class EngineDefaults:
    enforce_eager: bool
    gpu_memory_utilization: float
    why: str  # logged at start: which default applied and from what
    cpu: bool = False  # vLLM-CPU: the KV cache's size is ours to choose (kv_cache_size.py)


def gpu_utilization(model_bytes: int, gpu_bytes: int, device_staging: bool) -> float:
    """The largest fraction of the GPU vLLM may take that still leaves a
    push its memory (module docstring)."""
    outside = PUSH_SCRATCH_BYTES + (model_bytes + RECEIVE_BYTES if device_staging else 0)
    return max(MIN_UTILIZATION, round(VLLM_DEFAULT_UTILIZATION - outside / gpu_bytes, 3))


def resolve(settings: ServerSettings, model_bytes: int) -> EngineDefaults:
    """The settings as given, with each one left unset filled for this platform."""
    from vllm.platforms import current_platform

    eager, util = settings.enforce_eager, settings.gpu_memory_utilization
    if not current_platform.is_cuda_alike():
        return EngineDefaults(True if eager is None else eager,
                              CPU_UTILIZATION if util is None else util,
                              "CPU: eager mode" if eager is None else
                              f"CPU: enforce_eager={eager} (set)", cpu=True)
    why = "GPU: CUDA graphs" if eager is None else f"GPU: enforce_eager={eager} (set)"
    if util is None:
        gpu = current_platform.get_device_total_memory(0)
        device_staging = settings.weight_staging == "device"
        util = gpu_utilization(model_bytes, gpu, device_staging)
        staged = (f" + {model_bytes / 2**30:.2f} GiB device staging"
                  f" + {RECEIVE_BYTES / 2**30:.1f} GiB receive buffers") if device_staging else ""
        why += (f"; gpu_memory_utilization {util} = {VLLM_DEFAULT_UTILIZATION} - "
                f"({PUSH_SCRATCH_BYTES / 2**30:.0f} GiB push scratch{staged}"
                f") / {gpu / 2**30:.0f} GiB")
    return EngineDefaults(False if eager is None else eager, util, why)
