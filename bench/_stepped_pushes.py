"""Pushes of weights that real optimizer steps changed, for bench/push.py's delta row.

A delta of weights that did not change sends nothing and measures nothing (an
earlier push.py pushed the same model twice with the default pusher, which
now sends deltas, and printed 0 MiB). Here a trainer with fp32 master weights
takes AdamW steps on seeded random tokens and pushes after each: once with
`delta=False`, once with the default (`delta="auto"`).

Why the steps are replayed instead of pushing both forms after each step:
against one server a dense push overwrites the staged copy a delta patches,
so the next push could not be a delta; two servers would split the two cores.
Replaying (same checkpoint, same seed, AdamW on one thread: deterministic)
gives both forms the same weights, in turn, on the same server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import median

MiB = 2**20


@dataclass
class SteppedRun:
    """One form's pushes, the first (the checkpoint, dense for both) left out."""

    delta: bool
    encodings: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)  # why a delta push went dense
    nbytes: list[int] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)  # a delta's share of changed elements
    timings: list[dict[str, float]] = field(default_factory=list)


def stepped_pushes(url: str, token: str, load_model: Callable[[], torch.nn.Module],
                   version: int, steps: int, lr: float, bucket_mb: float, delta: bool,
                   batch: int = 2, seq: int = 64) -> tuple[SteppedRun, int]:
    """Push the checkpoint, then after each of `steps` AdamW steps; returns the
    run and the next free version. The probe is off: the transfer path alone."""
    from rollout_sidecar.trainer import WeightPusher

    model = load_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          probe=False, delta="auto" if delta else False)
    run = SteppedRun(delta)
    try:
        for step in range(steps + 1):
            if step:
                tokens = torch.randint(0, 256, (batch, seq), generator=g)
                opt.zero_grad()
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
            r = pusher.push(model, version=version)
            version += 1
            if not step:  # the base: nothing to diff against yet
                continue
            run.encodings.append(r.encoding)
            run.reasons.append(r.delta_reason)
            run.nbytes.append(r.nbytes)
            run.changed.append((r.changed or 0) / r.elements if r.elements else 0.0)
            run.timings.append(r.timings)
    finally:
        pusher.close()
    return run, version


def median_of(run: SteppedRun, key: str) -> float:
    return median([t.get(key, 0.0) for t in run.timings])


def row(size: str, lr: float, dense: SteppedRun, delta: SteppedRun) -> list[Any]:
    """One table row: bytes and times, dense / delta, medians over the steps."""
    deltas = sum(e == "delta" for e in delta.encodings)
    mib_dense, mib_delta = median(dense.nbytes) / MiB, median(delta.nbytes) / MiB
    push_dense, push_delta = median_of(dense, "total_s"), median_of(delta, "total_s")
    return [size, f"{lr:g}", f"{deltas}/{len(delta.encodings)}",
            f"{median(delta.changed):.2%}", f"{mib_dense:.1f}", f"{mib_delta:.2f}",
            f"{mib_dense / mib_delta:.1f}x", f"{median_of(delta, 'diff_s'):.3f}",
            f"{median_of(dense, 'gather_send_s'):.3f} / {median_of(delta, 'gather_send_s'):.3f}",
            f"{median_of(dense, 'server_commit_s'):.3f} / "
            f"{median_of(delta, 'server_commit_s'):.3f}",
            f"{push_dense:.3f} / {push_delta:.3f}", f"{push_dense / push_delta:.2f}x"]


HEADERS = ["size", "lr", "delta pushes", "changed (median)", "MiB dense", "MiB delta",
           "bytes ratio", "diff s", "send s dense / delta", "commit s dense / delta",
           "push s dense / delta", "push ratio"]
