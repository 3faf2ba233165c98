"""Rank 0's extra peak memory during a push: one bucket per big tensor vs split.

A model with a real vocabulary (a 151936 x --hidden embedding and lm_head,
plus a few small layers) is planned by `plan_buckets` and packed and sent by
the pusher's own `BucketSender`, to a transport that drops the bytes: no
server, since only rank 0's memory is measured. "before" plans with
`split=False` (a tensor larger than a bucket gets a bucket of its own, as
before chunked manifests), "after" with the default split. Each run is a fresh
spawned process, so the first allocation of the two send buffers counts.

Two sources of the tensors rank 0 packs:
- module: the parameters of a plain module (nothing is gathered);
- gathered: each tensor freshly materialised as it is drawn, as FSDP2's
  `full_tensor()` does. That costs the largest tensor in both plans (the
  pusher gathers one tensor at a time); splitting bounds only the buffers.

Two figures, because neither alone is honest: `send buffers` is what the
sender allocated (2 x its largest bucket; virtual), and `extra peak RSS` is the
kernel's high-water mark over the push minus RSS before it (VmHWM reset via
/proc/self/clear_refs; see push.py). RSS counts only touched pages: a buffer
slot that never held a big bucket stays partly untouched. With the default 6
layers (two buckets of them at 16 MiB) the embedding and the lm_head land in
different slots, so "before" touches both big buffers, as it does in about
half of real models (the parity of the lm_head's bucket decides).

    /work/venv/bin/python bench/push_memory.py [--hidden 512 --bucket-mb 16]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Iterator
from typing import Any

import torch
from _common import PeakRss, in_fresh_process, load, machine, table
from torch import nn

MiB = 2**20
VOCAB = 151936  # Qwen2/3's
WIRE = torch.bfloat16


def build(hidden: int, layers: int, dtype: torch.dtype) -> nn.Module:
    m = nn.Module()
    m.embed_tokens = nn.Embedding(VOCAB, hidden, dtype=dtype)
    m.layers = nn.ModuleList(
        nn.Sequential(nn.Linear(hidden, 4 * hidden, bias=False, dtype=dtype),
                      nn.Linear(4 * hidden, hidden, bias=False, dtype=dtype))
        for _ in range(layers))
    m.lm_head = nn.Linear(hidden, VOCAB, bias=False, dtype=dtype)
    return m.requires_grad_(False)


class DropTransport:
    """Sends nowhere: rank 0's packing and buffers without a server."""

    buffer_device = torch.device("cpu")
    checksum_in_request = False
    bucket_macs = None
    slot_pieces = False

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: Any = None) -> Any:
        return self

    def wait(self) -> None:
        pass


def drawn(model: nn.Module, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors

    for name, t in iter_full_tensors(model):
        yield name, (t.clone() if source == "gathered" else t)


def child(args: argparse.Namespace, source: str, split: bool, out: Any) -> None:
    from rollout_sidecar.trainer.gather.full_tensors import param_plan
    from rollout_sidecar.trainer.pack.buckets import plan_buckets
    from rollout_sidecar.trainer.pack.sender import BucketSender

    torch.set_num_threads(1)
    model = build(args.hidden, args.layers, getattr(torch, args.trainer_dtype))
    param_plan(model)  # imports torch.distributed.fsdp: ~100 MiB and seconds, not the push's
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed init memory cannot hide a push
    sender = BucketSender()
    with PeakRss() as m:
        t0 = time.perf_counter()
        buckets = plan_buckets(param_plan(model), WIRE, int(args.bucket_mb * MiB), split=split)
        _, err = sender.send_all(buckets, drawn(model, source), DropTransport(), ["bench"])
        elapsed = time.perf_counter() - t0
    assert err is None, err
    out.send(dict(buckets=len(buckets), largest=max(b.nbytes for b in buckets),
                  buffers=sum(b.numel() for b in sender._buffers), extra=m.extra,
                  send_s=elapsed, method=m.method))


def run(args: argparse.Namespace, source: str, split: bool) -> dict[str, Any]:
    return in_fresh_process(child, (args, source, split),
                            f"{source}/{'split' if split else 'whole'}", timeout_s=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)
    embed = VOCAB * args.hidden * WIRE.itemsize
    print(f"model: embedding and lm_head {VOCAB} x {args.hidden} ({embed / MiB:.0f} MiB each "
          f"in bf16), {args.layers} layers; trainer {args.trainer_dtype}, bf16 on the wire; "
          f"bucket {args.bucket_mb:g} MiB", flush=True)
    t0 = time.perf_counter()
    rows, ratios = [], []
    for source in ("module", "gathered"):
        res = {split: run(args, source, split) for split in (False, True)}
        for split, r in res.items():
            rows.append([source, "after: split" if split else "before: whole", r["buckets"],
                         f"{r['largest'] / MiB:.1f}", f"{r['buffers'] / MiB:.1f}",
                         f"{r['extra'] / MiB:.1f}", r["send_s"]])
        before, after = res[False], res[True]
        ratios.append([source, before["buffers"] / after["buffers"],
                       before["extra"] / after["extra"]])
    print(f"\n== rank-0 extra peak during one push (fresh process each; {res[True]['method']}) ==")
    print(table(["source", "plan", "buckets", "largest bucket MiB", "send buffers MiB",
                 "extra peak RSS MiB", "pack+send s"], rows))
    print()
    print(table(["source", "buffers before/after", "extra peak RSS before/after"], ratios))
    print(f"\nbench wall time: {time.perf_counter() - t0:.0f}s; at the end {load()}")


if __name__ == "__main__":
    main()
