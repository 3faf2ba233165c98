"""LoRA adapter pushes against merged full pushes, side by side in one run.

Per model (the embedded default, and the 100M Llama of bench/push.py) two
real servers start with --enable-lora (bf16): A takes adapter pushes, B takes
the same model merged (`adapter=False`): a merged push changes a server's
full weights, so one server cannot take both without every adapter push
carrying the base again. Per rank r, a PEFT model (LoRA on every linear,
alpha = 2r) first pushes to A with its base (left out of the medians),
then `--steps` times: its factors move (a stand-in for an optimizer step),
it pushes to A as an adapter and to B merged. Reported: bytes on the wire,
the whole push (gather, send, check, commit; the probe off for both), and
the server's commit (drain + load + publish, the slowest replica's).

    .venv/bin/python bench/push_adapter.py [--sizes default,100m] [--ranks 8,64]
        [--steps 5]
"""

from __future__ import annotations

import argparse
import secrets
import time
from pathlib import Path

import torch
from _common import build_llama, default_model, machine, median, serve, table
from push import SIZES

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(ckpt: Path, r: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=LINEAR))


def step(model: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def measure(ckpt: Path, name: str, ranks: list[int], steps: int, workdir: Path,
            bucket_mb: float) -> list[list[object]]:
    from rollout_sidecar.trainer import WeightPusher

    token = secrets.token_hex(16)
    env = {"ROLLOUT_SIDECAR_ENABLE_LORA": "1", "ROLLOUT_SIDECAR_MAX_LORA_RANK": "64",
           "ROLLOUT_SIDECAR_ADMIN_TOKEN": token, "ROLLOUT_SIDECAR_API_TOKEN": "api-" + token}
    rows = []
    with serve(ckpt, workdir / f"{name}-adapter.log", env=env, cpus="0") as a, \
            serve(ckpt, workdir / f"{name}-merged.log", env=env, cpus="1") as b:
        params = sum(p.numel() for p in peft_model(ckpt, 8).get_base_model().parameters())
        version = max(a.weight_version(), b.weight_version()) + 1
        for r in ranks:
            model = peft_model(ckpt, r)
            g = torch.Generator().manual_seed(r)
            by_adapter = WeightPusher(a.url, token, bucket_mb=bucket_mb, probe=False,
                                      adapter=True)
            merged = WeightPusher(b.url, token, bucket_mb=bucket_mb, probe=False, adapter=False)
            got: dict[str, list] = {"adapter": [], "merged": []}
            try:
                first = by_adapter.push(model, version=version)
                assert first.encoding == "adapter+base", first.encoding
                merged.push(model, version=version)
                version += 1
                for _ in range(steps):
                    step(model, g)
                    x = by_adapter.push(model, version=version)
                    y = merged.push(model, version=version)
                    assert x.encoding == "adapter" and y.encoding == "dense"
                    got["adapter"].append(x)
                    got["merged"].append(y)
                    version += 1
            finally:
                by_adapter.close()
                merged.close()

            nb = {k: median([p.nbytes for p in v]) for k, v in got.items()}
            push = {k: median([p.timings["total_s"] for p in v]) for k, v in got.items()}
            load_s = {k: median([p.timings["server_commit_s"] for p in v])
                      for k, v in got.items()}
            print(f"{name} r={r}: {nb['adapter'] / 2**20:.2f} / {nb['merged'] / 2**20:.1f} MiB, "
                  f"push {push['adapter']:.3f} / {push['merged']:.3f} s", flush=True)
            rows.append([name, f"{params / 1e6:.0f}M", r, f"{nb['merged'] / 2**20:.1f}",
                         f"{nb['adapter'] / 2**20:.2f}", f"{nb['merged'] / nb['adapter']:.0f}x",
                         f"{push['merged']:.3f}", f"{push['adapter']:.3f}",
                         f"{push['merged'] / push['adapter']:.1f}x",
                         f"{load_s['merged']:.3f}", f"{load_s['adapter']:.3f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="default,100m", help=f"default and/or {list(SIZES)}")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rollout-sidecar-bench"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = []
    for size in args.sizes.split(","):
        ckpt = default_model() if size == "default" else build_llama(*SIZES[size])
        rows += measure(ckpt, size, [int(r) for r in args.ranks.split(",")], args.steps,
                        args.workdir, args.bucket_mb)
    print(f"\nadapter vs merged full pushes, bf16 servers with --enable-lora, loopback gloo, "
          f"medians over {args.steps} steps; {time.monotonic() - t0:.0f}s; {machine()}")
    print(table(["model", "params", "r", "MiB merged", "MiB adapter", "bytes ratio",
                 "push s merged", "push s adapter", "push ratio", "server load s merged",
                 "server load s adapter"], rows))


if __name__ == "__main__":
    main()
