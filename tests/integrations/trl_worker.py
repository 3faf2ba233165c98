"""The real TRL GRPOTrainer against a real server: one process (plain
python), or every rank of `accelerate launch` (DDP, FSDP2) or torchrun.

--backend sidecar: `rollout_func=sidecar_rollout_func()` (the integration).
--backend vllm_client: a rollout function that pushes through the same
  `SidecarRollout.prepare` but generates with TRL's own `VLLMClient.generate`
  against our /v1/completions (the version comes from X-Weight-Version).
--sync callback: also push at every `on_step_end` (the alternative sync point,
  to count the pushes no generation reads).

$ROLLOUT_SIDECAR_URL and the tokens come from the environment. Each rank
writes rank<r>.json into --out: push and generation records, the versions the
reward function received, the model types TRL held, and (rank 0) TRL's log
history.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def vllm_client_rollout(sidecar, url: str, token: str):
    """A rollout function on TRL's VLLMClient (generation only)."""
    from trl.generation.vllm_client import VLLMClient

    class BearerVLLMClient(VLLMClient):
        # VLLMClient sends no Authorization header; our /v1 routes want the API token.
        def _get(self, url, **kw):
            return super()._get(url, headers={"Authorization": f"Bearer {token}"}, **kw)

        def _post(self, url, **kw):
            return super()._post(url, headers={"Authorization": f"Bearer {token}"}, **kw)

    client = BearerVLLMClient(base_url=url)
    served: list[int] = []  # X-Weight-Version of each /v1/completions answer
    client.session.hooks["response"].append(
        lambda r, *a, **k: served.append(int(r.headers["X-Weight-Version"]))
        if r.request.path_url.startswith("/v1/completions") else None)

    def rollout_func(prompts, trainer):
        version = sidecar.prepare(trainer)
        prompt_ids = sidecar.tokenize(prompts, trainer)
        out = client.generate(prompt_ids, n=1, temperature=trainer.temperature,
                              max_tokens=trainer.max_completion_length, logprobs=0,
                              generation_kwargs={"min_weight_version": version})
        versions = [served[-1]] * len(prompt_ids)
        sidecar.record_generation(trainer, versions)
        return {"prompt_ids": prompt_ids, "completion_ids": out["completion_ids"],
                "logprobs": [[lp[0] for lp in seq] for seq in out["logprobs"]],
                "weight_version": versions}

    return rollout_func


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--steps-per-generation", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="per-device batch")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--backend", choices=["sidecar", "vllm_client"], default="sidecar")
    ap.add_argument("--sync", choices=["rollout", "callback"], default="rollout")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout_sidecar.trainer.integrations.trl import sidecar_rollout_func

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [f"count to {i}: " for i in range(64)]})
    received: list[int] = []

    def reward_letters(completions, weight_version, **kwargs):
        received.extend(weight_version)  # the extra field reaches reward functions
        # The demo's reward (the share of a-z), plus a small tie-break by the
        # characters' codes: a group whose shares tie (all 0 early on) still has
        # advantages, so every step has gradients and new weights to push.
        return [(sum("a" <= ch <= "z" for ch in c) + sum(map(ord, c)) * 1e-5) / max(1, len(c))
                for c in completions]

    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.batch,
        num_generations=4, max_completion_length=8, max_steps=args.steps,
        steps_per_generation=args.steps_per_generation, temperature=args.temperature,
        learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", seed=0,
        use_cpu=True, bf16=False, dataloader_num_workers=0)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")

    sidecar = sidecar_rollout_func()
    rollout = sidecar if args.backend == "sidecar" else vllm_client_rollout(
        sidecar, os.environ["ROLLOUT_SIDECAR_URL"], os.environ["ROLLOUT_SIDECAR_API_TOKEN"])
    callbacks = []
    if args.sync == "callback":
        class PushAtStepEnd(TrainerCallback):
            def on_step_end(self, _args, state, control, **kwargs):
                sidecar.sync_weights()

        callbacks.append(PushAtStepEnd())

    trainer = GRPOTrainer(model=model, reward_funcs=reward_letters, args=config,
                          train_dataset=dataset, processing_class=tok, rollout_func=rollout,
                          peft_config=peft_config, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()

    rank = trainer.accelerator.process_index
    report = {
        "rank": rank, "world_size": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step, **sidecar.records(),
        "reward_versions": received, "logprobs_mode": sidecar.logprobs_mode,
        "use_vllm": trainer.use_vllm,
        "model_type": type(trainer.model).__name__,
        "wrapped_type": type(trainer.model_wrapped).__name__,
        "param_type": type(next(trainer.model.parameters())).__name__,
        "sidecar_warnings": [str(w.message) for w in caught
                             if str(w.message).startswith("rollout-sidecar")],
        "log_history": trainer.state.log_history if rank == 0 else None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
