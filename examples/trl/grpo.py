"""GRPO with TRL's GRPOTrainer, generating through rollout-sidecar.

The two lines marked `# sidecar` are all a GRPO script adds: TRL calls the
rollout function on every rank, which pushes the trained weights whenever the
optimizer stepped and samples with `min_weight_version` set to that push.

    ROLLOUT_SIDECAR_ADMIN_TOKEN=change-me rollout-sidecar serve --dtype float32 \
        --logprobs-mode processed_logprobs &
    export ROLLOUT_SIDECAR_URL=http://127.0.0.1:8000 ROLLOUT_SIDECAR_ADMIN_TOKEN=change-me
    python examples/trl/grpo.py                          # one process
    torchrun --nproc-per-node 2 examples/trl/grpo.py     # two DDP ranks
    accelerate launch --config_file examples/trl/fsdp2_cpu.yaml examples/trl/grpo.py
"""

import argparse

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer.integrations.trl import sidecar_rollout_func  # sidecar


def reward_letters(completions, weight_version, **kwargs):
    """The share of a-z letters. `weight_version`: the weights each completion came from."""
    return [sum("a" <= ch <= "z" for ch in c) / max(1, len(c)) for c in completions]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the checkpoint the server serves")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (pushed merged)")
    args = ap.parse_args()
    model = args.model or GenerationClient().info().model
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    config = GRPOConfig(
        output_dir="grpo-sidecar", max_steps=args.steps, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=16, learning_rate=1e-4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
        bf16=False, model_init_kwargs={"dtype": torch.float32})
    dataset = Dataset.from_dict({"prompt": [f"Say something about {w}: " for w in
                                            ["apples", "bananas", "cats", "dogs"] * 16]})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_letters, args=config,
                          train_dataset=dataset, peft_config=peft_config,
                          rollout_func=sidecar_rollout_func())  # sidecar
    trainer.train()
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print(f"step {entry['step']}: reward {entry['reward']:.3f} from weight_version "
                  f"{entry['sidecar/weight_version']:.0f}")
