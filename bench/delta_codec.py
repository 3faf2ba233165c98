"""Sparse patch forms side by side (protocol/data_plane/delta_codec.py), no server.

1. How much of a bf16 model changes in one optimizer step: a small Llama with
   fp32 master weights, one AdamW step at RL learning rates, cast to bf16
   before and after (the serving dtype is what a push compares).
2. For one 4096 x 4096 bf16 tensor at densities 0.1% .. 90%: each form's bytes
   (as a share of dense), encode and apply time, and the push time of the best
   form against dense at 2, 10 and 25 Gbit/s (wire + encode + apply).
3. The trainer's diff of one rank's piece (fp32 master against its bf16 copy,
   one thread): whole-tensor ops against ShardCopy's chunked scan.

    python bench/delta_codec.py [--size 4096] [--repeats 3] [--diff-numel 67108864]
"""

from __future__ import annotations

import argparse
import time

import torch

from rollout_sidecar.protocol.data_plane.delta_codec import PatchForm, apply, bits, encode

LINKS_GBIT = (2, 10, 25)


def changed_share_after_a_step(lr: float) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(cfg)
    before = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (8, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    diff = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(after, before, strict=True))
    return diff / sum(b.numel() for b in before)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--diff-numel", type=int, default=64 << 20)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    print("bf16 elements changed by one AdamW step (fp32 master, small Llama):")
    for lr in (1e-7, 1e-6, 1e-5):
        print(f"  lr {lr:g}: {changed_share_after_a_step(lr):.2%}")

    g = torch.Generator().manual_seed(0)
    base = torch.randn(args.size, args.size, generator=g).to(torch.bfloat16)
    dense_bytes = base.numel() * base.element_size()
    print(f"\none {args.size}x{args.size} bf16 tensor ({dense_bytes / 1e6:.1f} MB dense); "
          "bytes as a share of dense, encode / apply ms; push s = wire + encode + apply")
    forms = [PatchForm.INDEX, PatchForm.GAPS, PatchForm.BITMAP]
    head = " ".join(f"{f.value:>20}" for f in forms)
    links = " ".join(f"{f'{gb} Gbit/s best/dense':>22}" for gb in LINKS_GBIT)
    print(f"{'density':>8} {head} {'auto':>7} {links}")
    for density in (0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9):
        hit = torch.rand(base.shape, generator=g) < density
        new = base.clone()
        new[hit] = (base[hit].float() + 0.01).to(torch.bfloat16)
        cells, cost = [], {}
        for form in forms:
            try:
                patch = encode(new, base, form)
            except ValueError:  # gaps: changes too far apart
                cells.append(f"{'-':>20}")
                continue
            enc = timed(lambda f=form, n=new: encode(n, base, f), args.repeats)
            out = base.clone()
            app = timed(lambda p=patch, o=out: apply(p, o), args.repeats)
            assert torch.equal(bits(out), bits(new))
            cost[form] = (patch.nbytes, enc + app)
            cells.append(f"{patch.nbytes / dense_bytes:>6.1%} {enc * 1e3:>6.0f}/{app * 1e3:<5.0f}")
        auto = encode(new, base).form
        speed = []
        for gb in LINKS_GBIT:
            wire = 8 / (gb * 1e9)
            dense_s = dense_bytes * wire
            best_s = min(n * wire + s for n, s in cost.values())
            speed.append(f"{best_s:>9.3f}/{dense_s:<6.3f}{dense_s / best_s:>5.1f}x")
        print(f"{density:>8.1%} {' '.join(cells)} {auto.value:>7} {' '.join(speed)}")
    diff_side_by_side(args.diff_numel, args.repeats)


def diff_side_by_side(numel: int, repeats: int) -> None:
    from rollout_sidecar.trainer.delta.shard_copy import ShardCopy, _diff_whole
    from rollout_sidecar.trainer.delta.shard_pieces import Piece

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    print(f"\nthe diff of a {numel / 1e6:.0f}M-element piece against its bf16 copy, 1 thread "
          "(0%: a no-op push):")
    print(f"{'piece':>6} {'density':>8} {'whole s':>8} {'chunked s':>10} {'ratio':>6}")
    for dtype, density in ((torch.float32, 0.0), (torch.float32, 0.01),
                           (torch.float32, 0.05), (torch.bfloat16, 0.0),
                           (torch.bfloat16, 0.01)):
        master = (torch.randn(numel, generator=g) * 0.02).to(dtype)
        copy = ShardCopy()
        piece = Piece("w", 0, master)
        copy.refresh([piece], [torch.bfloat16], 1)
        master += 1e-3 * (torch.rand(numel, generator=g) < density)
        whole = timed(lambda c=copy, p=piece: _diff_whole(p, c._tensors[0], 0.25), repeats)
        chunked = timed(lambda c=copy, p=piece: c.diff(0, p, 0.25), repeats)
        a, b = _diff_whole(piece, copy._tensors[0], 0.25), copy.diff(0, piece, 0.25)
        assert (a.count, a.first, a.last, a.max_gap) == (b.count, b.first, b.last, b.max_gap)
        if density == 0:
            assert a.count == b.count == 0
        else:
            assert torch.equal(a.where, b.where) and torch.equal(bits(a.values), bits(b.values))
        print(f"{str(dtype)[6:]:>6} {density:>8.1%} {whole:>8.3f} {chunked:>10.3f} "
              f"{whole / chunked:>5.2f}x")
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
