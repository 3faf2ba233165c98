"""Run under torchrun (2 ranks, gloo): prove served = trained for one family.

For each wrapper in --wrappers (fsdp2, hsdp, fsdp1): load the checkpoint in fp32,
take one optimizer step, take torch's own full state dict (FSDP2:
`get_model_state_dict(full_state_dict=True)`; FSDP1: `summon_full_params`,
since its full state dict segfaults on CPU), push, then compare the server's
logprobs with a transformers fp32 forward of that state dict. Rank 0 writes a
JSON report; the pytest side asserts on it.

--scenario push (default), nan (a parameter set to NaN before the push), or
bf16: first push the checkpoint's own weights unchanged (a bf16 server must
then serve bit-identical logprobs), then step and push as usual.

--scenario quant: the identity push, a step, then a second step pushed with
one layer's re-quantization skipped (`--skip-layer`, armed in `--failpoints`),
then the same weights pushed again, whole.

--scenario delta: as push, then each wrapper pushes once more after a sparse update
(2% of every shard's elements moved): that push goes as a delta (a run named
`<wrapper>+delta`, with its `encoding`), and is held to the same fp32 oracle.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rollout_sidecar.trainer.collectives import all_gather_object
from tests.fsdp_wrap import full_state_dict, wrap
from tests.rank_worker import main, server_info

PROMPT = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "hello world"
# Scored sequences: 8 x 48 tokens, so that in bf16 one MoE routing flip on a
# near-tie (a discrete jump of a few tenths of a nat) cannot dominate the mean.
SCORED_SEQS, SCORED_LEN = 8, 48


def build(model_path: str, wrapper: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return wrap(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), wrapper)


def step(model: torch.nn.Module, vocab: int) -> None:
    """One Adam step on random tokens: moves logprobs by 0.08-0.2, as an RL step
    might (above the 0.05 that separates "pushed" from "stale"). The
    persistent buffers move too, as a loss-free MoE balancer moves its router
    bias between steps; the same seed on every rank keeps them replicated."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (4, 32), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for m in model.modules():
            for name, buf in m._buffers.items():
                if (buf is not None and buf.is_floating_point()
                        and name not in m._non_persistent_buffers_set):
                    buf.add_(torch.randn(buf.shape, generator=g) * 0.3)


def reference(model_path: str, state: dict | None, round_to: torch.dtype | None = None):
    """transformers fp32 model, optionally with weights rounded to the serving dtype."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if state is not None:
        if round_to is not None:
            state = {k: v.to(round_to).float() for k, v in state.items()}
        res = m.load_state_dict(state, strict=False)
        # torch's full state dict names a tied head once; anything else is a bug.
        tied = {"lm_head.weight"} if m.config.tie_word_embeddings else set()
        assert set(res.missing_keys) <= tied and not res.unexpected_keys, res
    return m.eval()


def logprobs(m: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """logprob of ids[i] given ids[:i] for i >= start."""
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=x).logits[0].float(), -1)
    return lp[start - 1:-1].gather(-1, x[0, start:, None])[:, 0]


def served(client, version: int, scored: list[list[int]]) -> dict:
    r = client.generate(prompt_token_ids=[PROMPT], min_weight_version=version, sampling=dict(
        n=4, max_tokens=24, temperature=1.0, seed=7))
    s = client.score(scored, min_weight_version=version)
    return dict(version=r.weight_version, score_version=s.weight_version,
                suspect=r.weight_suspect,
                samples=[(smp.token_ids, smp.logprobs) for smp in r.results[0].samples],
                scored=[lp for res in s.results for lp in res.prompt_logprobs[1:]])


def gap_max(a, b) -> float:
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)
            ).abs().max().item()


def gap(a, b) -> float:
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)
            ).abs().mean().item()


def scored_logprobs(m: torch.nn.Module, scored: list[list[int]]) -> torch.Tensor:
    return torch.cat([logprobs(m, ids, 1) for ids in scored])


def save_checkpoint(model_path: str, model: torch.nn.Module, to: Path) -> None:
    """`model` as a checkpoint beside a copy of `model_path`'s other files
    (config, tokenizer)."""
    shutil.copytree(model_path, to, ignore=shutil.ignore_patterns("*.safetensors*", "*.bin"),
                    dirs_exist_ok=True)
    model.save_pretrained(to)


def compare(model_path: str, before: dict | None, after: dict, oracle: dict,
            scored: list[list[int]], serve_dtype: torch.dtype, save_to: Path | None = None
            ) -> dict:
    ref = reference(model_path, oracle)
    pre = reference(model_path, None)
    sample_gaps = []
    for toks, lps in after["samples"]:
        sample_gaps.append(gap(logprobs(ref, PROMPT + toks, len(PROMPT)), lps))
    ref_scored = scored_logprobs(ref, scored)
    pre_scored = scored_logprobs(pre, scored)
    out = dict(
        version_after=after["version"], suspect=after["suspect"],
        fp32_gap_sampled=sum(sample_gaps) / len(sample_gaps),
        fp32_gap_scored=gap(ref_scored, after["scored"]),
        step_moved=gap(ref_scored, pre_scored),
    )
    if serve_dtype != torch.float32:
        rounded_model = reference(model_path, oracle, serve_dtype)
        rounded = scored_logprobs(rounded_model, scored)
        out["gap_after_rounded_ref"] = gap(rounded, after["scored"])
        if save_to is not None:  # for a fresh server of the same weights (the test's oracle)
            save_checkpoint(model_path, rounded_model.to(serve_dtype), save_to)
            out.update(checkpoint=str(save_to), scored_tokens=scored,
                       served_scored=after["scored"])
        if before is not None:  # the server still held the checkpoint
            out["gap_v0"] = gap(pre_scored, before["scored"])
    return out


def sparse_update(model: torch.nn.Module, rank: int) -> None:
    """Move 2% of the elements of every rank's own shard: an update a delta
    push carries as patches even in fp32 serving (where an optimizer step
    changes nearly every element's bits)."""
    from rollout_sidecar.trainer.delta.shard_pieces import shard_pieces

    # As in training, a backward first: FSDP1 keeps the root gathered after
    # the probe's forward until one (a delta then goes dense: shard_pieces.py).
    model(input_ids=torch.tensor([PROMPT])).logits.sum().mul(0).backward()
    params = [p for _, p in model.named_parameters()]
    if params and all(hasattr(p, "to_local") for p in params):
        # FSDP2 and HSDP: each shard, moved alike in every replica group that
        # holds it (seeded by its place on the shard dim), as a step would.
        shards = [(p.to_local().view(-1), p.device_mesh.get_coordinate()[-1]) for p in params]
    else:
        shards = [(piece.data, rank) for piece in shard_pieces(model, rank) or []]
    with torch.no_grad():
        for i, (data, shard) in enumerate(shards):
            if not data.is_floating_point() or data.numel() == 0:
                continue
            g = torch.Generator().manual_seed(1000 * shard + i)
            hit = torch.rand(data.numel(), generator=g) < 0.02
            data[hit] += 0.05 * torch.randn(int(hit.sum()), generator=g)


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--wrappers", default="fsdp2")
    ap.add_argument("--scenario", default="push")
    ap.add_argument("--failpoints", default=None, help="quant: the server's failpoint file")
    ap.add_argument("--skip-layer", default=None, help="quant: the layer its last push skips")


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.trainer import WeightPusher, WeightPushError

    client, info = server_info(args.url)
    serve_dtype = getattr(torch, info["dtype"])
    g = torch.Generator().manual_seed(5)
    scored = torch.randint(0, info["vocab_size"], (SCORED_SEQS, SCORED_LEN), generator=g).tolist()
    # FSDP2: no gather (own rows, the default). A quantized server's pushes
    # go whole: the same weights pushed again after the negative control must
    # be reloaded, not diffed against a staged copy the control left unloaded.
    pusher = WeightPusher(args.url, bucket_mb=1,
                          delta=False if args.scenario == "quant" else "auto")
    report: dict = {"runs": []}

    version = info["weight_version"]
    for i, wrapper in enumerate(args.wrappers.split(",")):
        model = build(args.model, wrapper)
        before = served(client, version, scored) if client else None
        identity = None
        if args.scenario in ("bf16", "quant"):
            version += 1
            # Unchanged weights; its probe measures the floor later probes are held to.
            floor = pusher.push(model, version=version).probe
            if client:
                same = served(client, version, scored)
                identity = dict(version=same["score_version"],
                                max_abs_diff=gap_max(same["scored"], before["scored"]),
                                floor=floor.mean_abs_dlogp)
        step(model, info["vocab_size"])
        version += 1
        if args.scenario == "nan":
            with torch.no_grad():  # FSDP2: each rank poisons its own shard
                p = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
                p.to_local().view(-1)[0] = float("nan")
        oracle = full_state_dict(model, wrapper)
        run: dict = {"wrapper": wrapper, "version_pushed": version, "identity": identity}
        rounds = {"delta": [wrapper, wrapper + "+delta"],
                  # Pushes to a quantized server: a second step pushed with one layer's
                  # re-quantization skipped (the negative control), then the same
                  # weights pushed again, whole: one fresh server is the oracle of both.
                  "quant": [wrapper, wrapper + "+skipped", wrapper + "+again"]
                  }.get(args.scenario, [wrapper])
        for name in rounds:
            armed = name.endswith("+skipped")
            if armed and rank == 0:
                Path(args.failpoints).write_text(f"quant.skip:{args.skip_layer}")
            if name != wrapper and args.scenario == "quant":
                if not name.endswith("+again"):
                    step(model, info["vocab_size"])
                    oracle = full_state_dict(model, wrapper)
                version += 1
                run = {"wrapper": name, "version_pushed": version, "identity": None}
            elif name != wrapper:
                sparse_update(model, rank)
                version += 1
                oracle = full_state_dict(model, wrapper)
                run = {"wrapper": name, "version_pushed": version, "identity": None}
            try:
                res = pusher.push(model, version=version)
                run.update(error=None, probe=res.probe.model_dump() if res.probe else None,
                           timings=res.timings, encoding=res.encoding,
                           delta_reason=res.delta_reason, nbytes=res.nbytes,
                           senders=res.senders, own_rows=res.own_rows,
                           own_rows_reason=res.own_rows_reason)
            except WeightPushError as e:
                run.update(error=str(e), error_type=type(e).__name__)
            if armed and rank == 0:
                Path(args.failpoints).write_text("")
            # What every rank raised: a failed push must raise the same on all of them.
            run["error_types_by_rank"] = all_gather_object(run.get("error_type"))
            if rank == 0:
                status = client.info()
                run["version_now"] = status.weight_version
                if run["error"] is None:
                    after = served(client, version, scored)
                    run.update(compare(args.model, before if i == 0 and name == wrapper
                                       else None, after, oracle, scored, serve_dtype,
                                       Path(args.out).with_name(f"trained-{name}")))
                report["runs"].append(run)
            dist.barrier()
    return report


if __name__ == "__main__":
    main(body, arguments)
