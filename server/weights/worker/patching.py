"""A delta push, applied into the staged copy that the last push left resident.

After a load the worker keeps its staged buckets (staging.py): they hold, bit
for bit, the version just committed, in the wire dtype and the bucket layout
that push used, and they were already in memory as the next push's pool. A
delta push (`delta_base`) receives only patch buckets (small, in a second
`Staging`), checks them as any push (CRC, tags), and at the commit writes
each patch into the resident copy (`apply_patches`), which then loads through
the usual path: every tensor, all-or-nothing (reload.py).

The resident copy is right only while `ResidentCopy.version` says so: a push
that overwrote it in part (a dense push's receive, a patch half applied, a
load that failed) clears the version, and the next push must be dense. The
API process keeps the same bookkeeping (`WeightStatus.delta_base`) from the
outcomes it sees, and the trainer sends a delta only against that base.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_sidecar.protocol.data_plane.delta_codec import PatchForm, apply, read
from rollout_sidecar.protocol.data_plane.wire_format import slot_bytes, torch_dtype
from rollout_sidecar.protocol.schema import PatchInfo, TensorSlot
from rollout_sidecar.server.weights.worker.staging import Staging


@dataclass
class ResidentCopy:
    """Which version the staged buckets hold (None: unknown, a delta cannot
    apply)."""

    version: int | None = None

    def require(self, base: int) -> None:
        if self.version != base:
            held = "no complete version" if self.version is None else f"version {self.version}"
            raise ValueError(f"delta_base {base}: this worker's staged copy holds {held}; "
                             "the push must be dense")


def apply_patches(patches: Staging, resident: Staging) -> int:
    """Write every patch slot into the resident copy; returns the number of
    elements written. A slot for a tensor the resident copy lacks, or of
    another dtype or size, raises before anything is written."""
    staged = resident.flat_views()
    todo: list[tuple[TensorSlot, PatchInfo, torch.Tensor]] = []
    for b in patches.buckets:
        for p in b.params:
            view = staged.get(p.name)
            if view is None or p.patch is None:
                raise ValueError(f"{p.name}: no patch, or not in the staged copy")
            if view.dtype != torch_dtype(p.dtype) or view.numel() != p.numel:
                raise ValueError(f"{p.name}: the patch's dtype or size differs from the "
                                 "staged copy's")
            todo.append((p, p.patch, slot_bytes(b.buffer, p)))
    written = 0
    for p, info, raw in todo:
        patch = read(raw, PatchForm(info.form), p.numel, info.changed,
                     torch_dtype(p.dtype))
        apply(patch, staged[p.name])
        written += info.changed
    return written
