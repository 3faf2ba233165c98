"""A LoRA model pushed as its adapter: helpers for tests/e2e/test_adapter_push.py,
and its torchrun worker (2 ranks, gloo, FSDP2): two adapter pushes (the first
carries the base), a "training step" between them; rank 0 scores the served
logprobs against PEFT's `merge_and_unload()` of a copy and writes --out."""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

from tests.e2e.peft_push_worker import LINEAR, gaps, scored_sequences, served
from tests.rank_worker import main, server_info


def build_lora(model_path: str, seed: int, r: int = 8, alpha: int = 16,
               targets: list[str] | None = None) -> torch.nn.Module:
    """The same LoRA model on every rank, B random (not PEFT's zeros)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)  # lora_A's init
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha,
                                            target_modules=targets or LINEAR))
    step(model, seed)
    return model


def step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every factor moves."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
            elif "lora_A" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def oracle_copy(model: torch.nn.Module, like: torch.nn.Module) -> torch.nn.Module:
    """`like` (an unsharded PEFT model of the same structure) holding `model`'s
    values, gathered by torch's own `full_tensor()` (every rank calls this)."""
    values = [full_tensor(p.detach()) for p in model.parameters()]
    out = copy.deepcopy(like)
    with torch.no_grad():
        for p, v in zip(out.parameters(), values, strict=True):
            p.copy_(v)
    return out


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)


def body(args: argparse.Namespace, rank: int) -> list[dict]:
    from rollout_sidecar.trainer import WeightPusher, WeightPushError
    from tests.fsdp_wrap import wrap

    warnings.simplefilter("ignore")
    client, info = server_info(args.url)
    seqs = scored_sequences(info["vocab_size"])
    model = build_lora(args.model, seed=21)
    like = copy.deepcopy(model)
    model = wrap(model, "fsdp2", model.get_base_model().model.layers)
    pusher = WeightPusher(args.url, bucket_mb=1, probe_tolerance=1e-4, adapter=True)
    version = info["weight_version"]
    report: list[dict] = []
    for i in range(2):
        if i:
            with torch.no_grad():  # each rank moves its own shard of every factor
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        local = p.to_local()
                        local.add_(torch.randn(local.shape, generator=torch.Generator()
                                               .manual_seed(7 + rank)) * 0.01)
        version += 1
        try:
            res = pusher.push(model, version=version)
            r: dict = dict(error=None, version=res.version, encoding=res.encoding,
                           nbytes=res.nbytes, probe_passed=res.probe.passed,
                           probe_gap=res.probe.mean_abs_dlogp)
        except WeightPushError as e:
            r = dict(error=str(e))
        oracle = oracle_copy(model, like)
        if rank == 0 and r["error"] is None:
            r["served_version"], got = served(client, version, seqs)
            r.update(gaps(args.model, oracle, got, seqs))
        report.append(r)
    pusher.close()
    return report


if __name__ == "__main__":
    main(body, arguments)
