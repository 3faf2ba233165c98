"""The checkpoint layout of the trainer's tensors.

transformers 5 keeps some weights in memory in another layout than on disk:
MoE experts are one 3-D `experts.gate_up_proj` in the model but
`experts.{e}.gate_proj.weight` / `up_proj.weight` per expert in the checkpoint
(Qwen3-MoE, GLM-4.5, Mixtral, ...). The server expects the checkpoint's names
and shapes, so each gathered tensor is mapped back with transformers' own
reverse conversion, the one `save_pretrained` uses, one tensor at a time (so
memory stays bounded). Models without conversions pass through untouched, and
transformers is imported only for a transformers model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rollout_sidecar.trainer.gather.full_tensors import ParamInfo
from rollout_sidecar.trainer.gather.row_blocks import RowBlocks


def _inner(model: nn.Module) -> nn.Module:
    # DDP, DataParallel and an FSDP1 root keep the real model in `.module`.
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _conversions(model: nn.Module) -> list[Any]:
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return []
    found = getattr(model, "_weight_conversions", None)  # set by from_pretrained
    if found is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        found = get_model_conversion_mapping(model, add_legacy=False)
    return list(found or [])


class CheckpointLayout:
    def __init__(self, model: nn.Module) -> None:
        self.model = _inner(model)
        self.active = bool(_conversions(self.model))

    def _revert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(self.model, {name: tensor})
        if not out:
            raise RuntimeError(f"{name}: transformers' reverse conversion produced nothing; "
                               "it needs tensors pushed together (not supported)")
        return out

    def plan(self, params: list[ParamInfo]) -> list[ParamInfo]:
        """Checkpoint names and shapes, from shapes alone (meta tensors)."""
        if not self.active:
            return params
        out = []
        for p in params:
            meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
            out += [ParamInfo(n, tuple(t.shape), p.dtype) for n, t in
                    self._revert(p.name, meta).items()]
        return out

    def convert(self, tensors: Iterable[tuple[str, torch.Tensor | RowBlocks]]
                ) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
        """(checkpoint name, tensor) pairs, in `plan` order. A conversion
        needs the whole tensor: row blocks are joined first (rank 0 then holds
        that tensor whole, as `full_tensor()` would)."""
        for name, full in tensors:
            if self.active:
                if isinstance(full, RowBlocks):
                    full = full.materialize()
                yield from self._revert(name, full).items()
            else:
                yield name, full
