"""TRL's real AsyncGRPOTrainer (trl.experimental.async_grpo) against a real
server, through `SidecarAsyncGRPOTrainer` (trainer/integrations/trl_async.py).
One process; TRL spawns its rollout process itself.

Two CPU stand-ins for TRL parts that exist only on a GPU, neither of them in
the integration: TRL asks CUDA for the device's peak FLOPs while it builds
the trainer (an assert without CUDA), and its packed "tree" attention calls a
FlashAttention-3 kernel it fetches from the Hub. Here the first answers None
and the second is the same varlen attention in torch's SDPA, one packed
segment at a time.

$ROLLOUT_SIDECAR_URL and the tokens come from the environment. Writes
report.json into --out: the pushes, every sample TRL's dataset took from the
rollout queue (its version from our spans, the trainer's version then), and
TRL's log history.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def reward_letters(completions: list, **kwargs) -> list[float]:
    """The demo's reward (the share of a-z), plus a tie-break by character
    codes, so every group has advantages and every step new weights."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [(sum("a" <= ch <= "z" for ch in t) + sum(map(ord, t)) * 1e-5) / max(1, len(t))
            for t in texts]


def cpu_varlen_attention():  # noqa: ANN201
    """FlashAttention's `flash_attn_varlen_func`, in SDPA per packed segment
    (causal, aligned bottom-right as FlashAttention aligns it)."""
    import torch
    import torch.nn.functional as F

    class Kernel:
        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None,
                                   causal=True, window_size=(-1, -1), softcap=None, **_):
            out = torch.empty_like(q)
            heads, kv_heads = q.shape[1], k.shape[1]
            for s in range(len(cu_q) - 1):
                qs, qe, ks, ke = (int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]),
                                  int(cu_k[s + 1]))
                qi = q[qs:qe].transpose(0, 1)
                ki = k[ks:ke].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                vi = v[ks:ke].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                rows, cols = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
                mask = cols <= rows + (ke - ks) - (qe - qs)
                if window_size[0] >= 0:
                    mask &= cols >= rows + (ke - ks) - (qe - qs) - window_size[0]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                   scale=softmax_scale)
                out[qs:qe] = o.transpose(0, 1)
            return out

    return Kernel


class RecordingQueue:
    """The rollout queue as TRL's dataset reads it, keeping each sample's
    version and the trainer's version when it was taken."""

    def __init__(self, inner, trainer, taken: list[dict]) -> None:  # noqa: ANN001
        self.inner, self.trainer, self.taken = inner, trainer, taken

    def get(self, *args, **kwargs):  # noqa: ANN201
        sample = self.inner.get(*args, **kwargs)
        self.taken.append(dict(version=int(sample.model_version),
                               trainer_version=int(self.trainer.model_version),
                               tokens=int(sample.completion_mask.sum())))
        return sample

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def main() -> None:
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-staleness", type=int, default=1)
    args = ap.parse_args()

    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo_trainer
    import trl.experimental.async_grpo.packing as packing
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from rollout_sidecar.trainer.integrations.trl_async import SidecarAsyncGRPOTrainer

    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    packing._flash_attn = cpu_varlen_attention

    tok = AutoTokenizer.from_pretrained(args.model)
    # The default model's chat template is ChatML-like; transformers cannot
    # tell where an assistant turn starts in it without this.
    tok.response_template = {"defaults": {"role": "assistant"},
                             "start_anchor": "<|im_start|>assistant\n",
                             "fields": {"content": {"close_pattern": r"</s>\s*",
                                                    "content": "text"}}}
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}]
                                            for i in range(64)]})
    config = AsyncGRPOConfig(
        output_dir=str(Path(args.out) / "trainer"), max_steps=args.steps,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, token_budget=0,
        max_staleness=args.max_staleness, max_inflight_tasks=8,
        vllm_server_base_url=os.environ["ROLLOUT_SIDECAR_URL"], report_to=[],
        logging_steps=1, save_strategy="no", use_cpu=True, dtype="float32", bf16=False,
        seed=0)
    trainer = SidecarAsyncGRPOTrainer(model=args.model, reward_funcs=reward_letters,
                                      args=config, train_dataset=dataset,
                                      processing_class=tok)
    taken: list[dict] = []
    trainer.rollout_queue = RecordingQueue(trainer.rollout_queue, trainer, taken)
    trainer.train()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(dict(
        global_step=trainer.state.global_step, pushes=trainer.pushes, taken=taken,
        max_staleness=args.max_staleness, log_history=trainer.state.log_history), indent=1))
    print("report written", file=sys.stderr)


if __name__ == "__main__":
    main()
