"""What an adapter push of a PEFT model sends, and in which order.

Built on `PeftMerge`'s reading of the model (its LoRA layers, their
checkpoint names, PEFT's own `scaling` per layer), so the merged push and the
adapter push can never disagree on what the model computes. Two forms:

- adapter only: each LoRA layer's `lora_A` / `lora_B` of its active adapter,
  as `<checkpoint module>.lora_A.weight` / `.lora_B.weight`; every other
  parameter stays behind (FSDP2 and plain models gather only the factors);
- with base: every checkpoint tensor as the base model holds it (the LoRA
  layers' `base_layer` weights unmerged), then the factors as above: for a
  server whose full weights are not this model's base (its first adapter
  push, after a restart, after a merged push).

`refusal` says why a model cannot go as an adapter (it then goes merged):
more than one adapter active, LoRA on embeddings, `fan_in_fan_out` layers,
LoRA biases, `modules_to_save`, LoRA variants, adapters merged or disabled,
or a checkpoint conversion between the model's names and the server's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from rollout_sidecar.protocol.schema import AdapterSpec
from rollout_sidecar.protocol.schema.adapter_api import LORA_A, LORA_B
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo
from rollout_sidecar.trainer.gather.peft_merge import Gathered, PeftMerge, PeftMergeError
from rollout_sidecar.trainer.gather.row_blocks import RowBlocks


class LoraAdapter:
    def __init__(self, model: nn.Module) -> None:
        self.refusal: str | None = None
        self.scaling: dict[str, float] = {}  # checkpoint module -> PEFT's scaling
        self._roles: dict[str, str] = {}  # gathered factor name -> wire name
        self._merge: PeftMerge | None = None
        try:
            merge = PeftMerge(model)
        except PeftMergeError as e:
            self.refusal = str(e)
            return
        if not merge.active:
            self.refusal = "not a PEFT model"
            return
        self._merge = merge
        self.refusal = self._inspect(merge, model)

    @property
    def eligible(self) -> bool:
        return self.refusal is None

    def _inspect(self, merge: PeftMerge, model: nn.Module) -> str | None:
        if merge._wrappers:
            return f"modules_to_save ({sorted(merge._wrappers)[:3]}) travel only merged"
        if CheckpointLayout(merge.base_model).active:
            return "the model's tensors are converted to the checkpoint's layout"
        active: set[str] = set()
        for lora in merge._loras.values():
            where = lora.path or "<root>"
            if not lora.adapters:
                return f"{where}: its adapter is merged or disabled"
            if len(lora.adapters) > 1:
                return f"{where}: {len(lora.adapters)} adapters active (one is served)"
            if lora.embedding:
                return f"{where}: LoRA on an embedding"
            if lora.fan_in_fan_out:
                return f"{where}: fan_in_fan_out (Conv1D) layers"
            if lora.merges_bias:
                return f"{where}: lora_bias"
            if lora.out.rsplit(".", 1)[-1] in ("lm_head", "embed_out", "output"):
                return f"{where}: LoRA on the output head"
            a = lora.adapters[0]
            active.add(a)
            self.scaling[lora.out] = lora.scaling[a]
            for name, role in lora.pieces.items():
                if role == f"A.{a}":
                    self._roles[name] = lora.out + LORA_A
                elif role == f"B.{a}":
                    self._roles[name] = lora.out + LORA_B
        if not self.scaling:
            return "no LoRA layer"
        if len(active) > 1:
            return f"different adapters active in different layers ({sorted(active)})"
        return None

    def is_factor(self, gathered_name: str) -> bool:
        return gathered_name in self._roles

    def spec(self, base_version: int | None) -> AdapterSpec:
        return AdapterSpec(scaling=self.scaling, base_version=base_version)

    def plan(self, params: list[ParamInfo], with_base: bool) -> list[ParamInfo]:
        """Wire names, shapes and dtypes in `convert`'s order."""
        assert self._merge is not None
        out: list[ParamInfo] = []
        for p in params:
            wire = self._wire_name(p.name, with_base)
            if wire is not None:
                out.append(ParamInfo(wire, p.shape, p.dtype))
        return out

    def convert(self, tensors: Iterable[tuple[str, Gathered]], with_base: bool
                ) -> Iterator[tuple[str, Gathered]]:
        for name, t in tensors:
            wire = self._wire_name(name, with_base)
            if wire is None:
                continue
            if isinstance(t, RowBlocks) and name in self._roles:
                t = t.materialize()
            yield wire, t

    def _wire_name(self, name: str, with_base: bool) -> str | None:
        if name in self._roles:
            return self._roles[name]
        if not with_base:
            return None
        assert self._merge is not None
        kind, what = self._merge._route(name)
        if kind == "pass":
            return what
        if kind == "piece" and what.pieces[name] in ("weight", "bias"):
            return f"{what.out}.{what.pieces[name]}" if what.out else what.pieces[name]
        return None  # another adapter's factors, dropout, ...
