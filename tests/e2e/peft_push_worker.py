"""A PEFT-wrapped copy of the served model, pushed as merged weights; the
served prompt logprobs against a transformers fp32 forward of PEFT's own
`merge_and_unload()` of a copy. Used in-process (plain) by
tests/e2e/test_peft_push.py, and under torchrun (2 ranks, gloo) for FSDP2 and
FSDP1: `--wrappers fsdp2,fsdp1`, rank 0 writes a JSON report to --out.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

from tests.rank_worker import main, server_info

# Every linear of the served Llama, and a fully trained copy of its (untied) head.
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCORED_SEQS, SCORED_LEN = 4, 48


def build_peft(model_path: str, seed: int) -> torch.nn.Module:
    """The same LoRA model on every rank: B random (not PEFT's zeros), so the
    merged weights differ from the checkpoint; lm_head's copy moved too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)  # lora_A's init: the same on every rank
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LINEAR,
                                            modules_to_save=["lm_head"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return model


def scored_sequences(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab_size, (SCORED_SEQS, SCORED_LEN), generator=g).tolist()


def logprobs(m: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """logprob of every token but the first given the ones before it."""
    out = []
    with torch.no_grad():
        for ids in seqs:
            x = torch.tensor([ids])
            lp = torch.log_softmax(m(input_ids=x).logits[0].float(), -1)
            out.append(lp[:-1].gather(-1, x[0, 1:, None])[:, 0])
    return torch.cat(out)


def served(client, version: int, seqs: list[list[int]]) -> tuple[int, torch.Tensor]:
    r = client.score(seqs, min_weight_version=version)
    return r.weight_version, torch.tensor([lp for res in r.results
                                           for lp in res.prompt_logprobs[1:]])


def gaps(model_path: str, model: torch.nn.Module, got: torch.Tensor,
         seqs: list[list[int]]) -> dict:
    """Served vs the oracle (merge_and_unload of a copy, fp32 forward), and vs
    the checkpoint it replaced (the push moved the logprobs)."""
    from transformers import AutoModelForCausalLM

    oracle = copy.deepcopy(model).merge_and_unload().eval()
    pre = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    want, before = logprobs(oracle, seqs), logprobs(pre, seqs)
    return dict(gap=(got - want).abs().mean().item(), gap_max=(got - want).abs().max().item(),
                moved=(want - before).abs().mean().item())


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--wrappers", default="fsdp2,fsdp1")


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.trainer import WeightPusher, WeightPushError
    from tests.peft_merge_worker import shard

    warnings.simplefilter("ignore")
    client, info = server_info(args.url)
    seqs = scored_sequences(info["vocab_size"])
    pusher = WeightPusher(args.url, bucket_mb=1, probe_tolerance=1e-4)
    version = info["weight_version"]
    report: dict = {}
    for i, wrapper in enumerate(args.wrappers.split(",")):
        peft_model = build_peft(args.model, seed=10 + i)
        oracle_src = copy.deepcopy(peft_model) if rank == 0 else None
        model = shard(peft_model, wrapper)
        version += 1
        try:
            res = pusher.push(model, version=version)
            r: dict = dict(error=None, version=res.version, nbytes=res.nbytes,
                           probe_passed=res.probe.passed, probe_gap=res.probe.mean_abs_dlogp,
                           push_s=res.timings["total_s"])
        except WeightPushError as e:
            r = dict(error=str(e))
        if rank == 0 and r["error"] is None:
            r["served_version"], got = served(client, version, seqs)
            r.update(gaps(args.model, oracle_src, got, seqs))
        report[wrapper] = r
    pusher.close()
    return report


if __name__ == "__main__":
    main(body, arguments)
