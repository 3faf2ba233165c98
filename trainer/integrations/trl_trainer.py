"""What rollout-sidecar reads of TRL's `GRPOTrainer` and sets on it
(trl.py is the rollout function itself): the model a push gathers, whether
accelerate ran the FSDP that was asked for, the sampling settings that
decide which logprobs TRL's importance-sampling correction needs, and the
switches that turn that correction on for our samples (TRL 1.16).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from rollout_sidecar.trainer.integrations.trl import SidecarRollout


def push_target(trainer: Any) -> nn.Module:
    """The model whose parameters a push gathers: DDP's inner module (full
    parameters on every rank), else what the trainer wraps (FSDP2 shards in
    place, so its parameters are DTensor shards; an FSDP1 root; a plain or
    PEFT model)."""
    model = trainer.model_wrapped
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    return model


def fsdp_fallback(trainer: Any) -> str | None:
    """What went wrong when FSDP was asked for and accelerate ran something else.

    accelerate (1.15) turns an FSDP config into FSDP only on accelerator devices;
    on CPU its state stays MULTI_CPU and `prepare` wraps the model in DDP, with no
    message: every rank then holds and trains the whole model."""
    asked = (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
             or bool(getattr(trainer.args, "fsdp", None)))
    ran = str(trainer.accelerator.distributed_type)
    if not asked or ran.endswith("FSDP"):
        return None
    return (f"FSDP was configured but accelerate runs {ran.rsplit('.', 1)[-1]} "
            f"({type(trainer.model_wrapped).__name__}): accelerate enables FSDP only on "
            "GPU/XPU/NPU-class devices. Pushes still send full weights; for FSDP2 on CPU "
            "shard with fully_shard under torchrun (examples/fsdp_grpo_step.py)")


def changed_sampling(trainer: Any) -> list[str]:
    """The sampling settings that make processed logprobs differ from raw."""
    changed = []
    if trainer.temperature != 1.0:
        changed.append(f"temperature={trainer.temperature}")
    if trainer.top_k:
        changed.append(f"top_k={trainer.top_k}")
    if trainer.top_p != 1.0:
        changed.append(f"top_p={trainer.top_p}")
    return changed


def unsupported_sampling(trainer: Any) -> list[str]:
    bad = []
    if trainer.min_p:
        bad.append(f"min_p={trainer.min_p}")
    if trainer.repetition_penalty != 1.0:
        bad.append(f"repetition_penalty={trainer.repetition_penalty}")
    extra = set(trainer.args.generation_kwargs or {}) - {"stop"}
    if extra:
        bad.append(f"generation_kwargs {sorted(extra)}")
    return bad


def enable_importance_sampling(trainer: Any, rollout: SidecarRollout) -> None:
    """Turn on TRL's importance-sampling correction for our samples: TRL
    gates it on `use_vllm`, and with `use_vllm` it calls
    `vllm_generation.sync_weights()` whenever the step changed, which is ours."""
    args = trainer.args
    if trainer.loss_type == "vespo" and args.vllm_importance_sampling_mode not in (
            "token_truncate", "token_mask"):
        raise ValueError("VESPO loss requires `vllm_importance_sampling_mode` to be either "
                         "'token_truncate' or 'token_mask'")  # TRL's own check, skipped at init
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer.vllm_generation = rollout
    trainer.vllm_importance_sampling_correction = True


def close_at_train_end(rollout: SidecarRollout) -> Any:
    from transformers import TrainerCallback

    class CloseAtTrainEnd(TrainerCallback):
        """Releases the server connection when training ends."""

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rollout.close()

    return CloseAtTrainEnd()
