"""A PEFT (LoRA) model pushes as merged weights under the checkpoint's names.

The served checkpoint knows `model.layers.0.self_attn.q_proj.weight`; a
`PeftModel` holds `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`
plus `...q_proj.lora_A.default.weight` and `...lora_B.default.weight`. This
stage sits before `CheckpointLayout` in the pusher's chain: `plan()` maps the
gathered names and shapes to the checkpoint's, `convert()` streams the
gathered tensors in the same order, holding a base weight until the LoRA
factors of its layer have arrived and then emitting the weight the model's
own forward computes with: W + scaling * (B @ A) for every active adapter.

The arithmetic is PEFT's `merge()` (what `merge_and_unload()` runs), op for
op: the delta in the adapter's dtype (float32 on the CPU for half-precision
factors), transposed for `fan_in_fan_out`, times the layer's own
`scaling[adapter]` (so `lora_alpha`, rslora and per-module ranks are PEFT's),
added to the weight in the weight's dtype, adapter after adapter. In float32
the result equals `merge_and_unload()` of a copy. The user's model is never
changed: the merge reads the gathered tensors and writes new ones.

`modules_to_save` (a fully trained copy of e.g. `lm_head`) sends the copy the
forward uses under the module's own name; `original_module` stays behind.

Memory: a base weight waits, as a copy on rank 0, for the factors gathered
after it. Plain models and FSDP2 gather a layer's factors right after its
weight, so one weight waits at a time; FSDP1 units that wrap the LoRA modules
apart (PEFT's `fsdp_auto_wrap_policy`) gather them after the whole decoder
layer, so one decoder layer's LoRA-targeted weights wait. A large FSDP2 weight
that needs merging arrives as `RowBlocks` and is joined first, as
`CheckpointLayout` does.

Refused with `PeftMergeError` naming the module: tuners other than LoRA and
prompt learning, LoRA variants (DoRA, aLoRA, ...), LoRA on convolutions or
quantized and tensor-parallel layers, trainable tokens, a LoRA base weight
shared with another module (a tied head), and layers whose adapters were
merged only in part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo
from rollout_sidecar.trainer.gather.names import normalize_name
from rollout_sidecar.trainer.gather.row_blocks import RowBlocks

Gathered: TypeAlias = "torch.Tensor | RowBlocks"


class PeftMergeError(WeightPushError):
    """A PEFT model this push cannot send as merged weights."""


@dataclass
class _Lora:
    """One LoRA layer whose active adapters are merged."""

    path: str  # normalised module path, as the gathered names have it
    out: str  # the checkpoint's module path
    embedding: bool
    fan_in_fan_out: bool
    adapters: list[str]  # merged in this order, as PEFT's merge()
    scaling: dict[str, float]
    lora_bias: dict[str, bool]
    pieces: dict[str, str] = field(default_factory=dict)  # gathered name -> role

    @property
    def merges_bias(self) -> bool:
        return any(self.lora_bias[a] for a in self.adapters)


def _is_peft(m: nn.Module) -> bool:
    return type(m).__module__.startswith("peft.")


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    return model


class PeftMerge:
    """`plan` / `convert` for a PEFT model; a pass-through for any other."""

    def __init__(self, model: nn.Module) -> None:
        root = _unwrap(model)
        # Without peft's modules the stage is inert and peft is never imported.
        self.active = any(_is_peft(m) for m in root.modules())
        self.base_model = model  # what CheckpointLayout converts: the model inside
        self._prefix = ""
        self._loras: dict[str, _Lora] = {}
        self._wrappers: dict[str, str] = {}  # modules_to_save path -> the kept child's prefix
        if self.active:
            self._inspect(root)

    def _inspect(self, root: nn.Module) -> None:
        from peft import PeftModel
        from peft.tuners.lora import LoraModel
        from peft.tuners.lora.layer import Embedding, Linear
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        tied = _shared_params(root)
        named = [(normalize_name(n), m) for n, m in root.named_modules()]
        inside_wrapper: list[str] = []
        for path, m in named:
            # a subclass defined elsewhere is refused below, never passed through
            if not _is_peft(m) and not isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper):
                continue
            where = path or "<root>"
            if any(path.startswith(w + ".") for w in inside_wrapper):
                raise PeftMergeError(f"cannot push {where}: a PEFT module inside "
                                     "modules_to_save is not supported")
            if isinstance(m, PeftModel):
                continue
            if type(m) is LoraModel:
                if self._prefix:
                    raise PeftMergeError(f"cannot push {where}: more than one LoRA model")
                self._prefix = f"{path}.model." if path else "model."
                self.base_model = m.model
            elif type(m) in (Linear, Embedding):
                self._add_lora(path, m, type(m) is Embedding, tied)
            elif type(m) is ModulesToSaveWrapper:
                inside_wrapper.append(path)
                self._wrappers[path] = _kept_child(m)
            else:
                raise PeftMergeError(
                    f"cannot push {where}: {type(m).__module__}.{type(m).__qualname__} is not "
                    "supported (merged pushes support LoRA on nn.Linear / nn.Embedding, "
                    "and modules_to_save)")

    def _add_lora(self, path: str, m: Any, embedding: bool, tied: set[int]) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        where = path or "<root>"
        factors = m.lora_embedding_A if embedding else m.lora_A
        if isinstance(m.base_layer, BaseTunerLayer):
            raise PeftMergeError(f"cannot push {where}: stacked adapter layers")
        if m.merged:
            # PEFT's forward then runs the base layer alone: its weight is what
            # serves. Adapters active but not merged would be ignored there
            # and added by merge_and_unload(): ambiguous, refused.
            if m.disable_adapters or set(m.active_adapters) - set(m.merged_adapters):
                raise PeftMergeError(f"cannot push {where}: adapters merged in part "
                                     f"({m.merged_adapters} of {m.active_adapters}); "
                                     "unmerge_adapter() first")
            adapters: list[str] = []
        elif m.disable_adapters:
            adapters = []
        else:
            adapters = [a for a in m.active_adapters if a in factors]
        for a in adapters:
            if a in m.lora_variant or m.use_dora.get(a):
                variant = type(m.lora_variant.get(a)).__name__
                raise PeftMergeError(f"cannot push {where}: adapter {a!r} is a LoRA variant "
                                     f"({variant}); only plain LoRA is merged")
        base = m.get_base_layer()
        if any(m.lora_bias.get(a) for a in adapters) and getattr(base, "bias", None) is None:
            raise PeftMergeError(f"cannot push {where}: lora_bias without a bias in the base "
                                 "layer (PEFT cannot merge it either)")
        if adapters and id(base.weight) in tied:
            raise PeftMergeError(f"cannot push {where}: its base weight is shared with "
                                 "another module (tied embeddings); the merge would change both")
        lora = _Lora(path, self._strip(path), embedding, bool(m.fan_in_fan_out), adapters,
                     {a: float(m.scaling[a]) for a in adapters},
                     {a: bool(m.lora_bias.get(a, False)) for a in adapters})
        p = f"{path}." if path else ""
        if adapters:
            lora.pieces[f"{p}base_layer.weight"] = "weight"
        if lora.merges_bias:
            lora.pieces[f"{p}base_layer.bias"] = "bias"
        for a in adapters:
            if embedding:
                lora.pieces[f"{p}lora_embedding_A.{a}"] = f"A.{a}"
                lora.pieces[f"{p}lora_embedding_B.{a}"] = f"B.{a}"
            else:
                lora.pieces[f"{p}lora_A.{a}.weight"] = f"A.{a}"
                lora.pieces[f"{p}lora_B.{a}.weight"] = f"B.{a}"
                if lora.lora_bias[a]:
                    lora.pieces[f"{p}lora_B.{a}.bias"] = f"Bb.{a}"
        self._loras[path] = lora

    def _strip(self, name: str) -> str:
        return name[len(self._prefix):] if self._prefix and name.startswith(self._prefix) \
            else name

    def _route(self, name: str) -> tuple[str, Any]:
        """("pass", checkpoint name) | ("drop", None) | ("piece", _Lora)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            path, rest = ".".join(parts[:i]), ".".join(parts[i:])
            lora = self._loras.get(path)
            if lora is not None:
                if name in lora.pieces:
                    return "piece", lora
                if rest.startswith("base_layer."):
                    out = rest[len("base_layer."):]
                    return "pass", f"{lora.out}.{out}" if lora.out else out
                return "drop", None  # another adapter's factors, dropout, ...
            kept = self._wrappers.get(path)
            if kept is not None:
                if not rest.startswith(kept):
                    return "drop", None  # original_module, or another adapter's copy
                out = self._strip(path)
                return "pass", f"{out}.{rest[len(kept):]}" if out else rest[len(kept):]
        return "pass", self._strip(name)

    def rename(self, name: str) -> str | None:
        """The checkpoint name a gathered tensor travels under (None: not sent
        on its own). For persistent buffers, picked before the plan."""
        if not self.active:
            return name
        kind, what = self._route(name)
        if kind == "piece":
            return f"{what.out}.{what.pieces[name]}" if what.pieces[name] in ("weight", "bias") \
                else None
        return what if kind == "pass" else None

    def _walk(self, items: Iterable[tuple[str, Any]], hold: Any
              ) -> Iterator[tuple[str, Any, Any]]:
        """("pass", name, x) or ("merge", _Lora, {role: x}), in the order
        both `plan` and `convert` emit: a layer when its last piece arrived."""
        held: dict[str, dict[str, Any]] = {}
        for name, x in items:
            kind, what = self._route(name)
            if kind == "pass":
                yield "pass", what, x
            elif kind == "piece":
                got = held.setdefault(what.path, {})
                got[what.pieces[name]] = x
                if len(got) < len(what.pieces):
                    got[what.pieces[name]] = hold(x)  # later gathers may free its storage
                else:
                    yield "merge", what, held.pop(what.path)
        if held:
            left = {p: sorted(set(self._loras[p].pieces.values()) - set(g))
                    for p, g in held.items()}
            raise RuntimeError(f"LoRA layers never received every piece: {left}")

    def plan(self, params: list[ParamInfo]) -> list[ParamInfo]:
        """Checkpoint names, shapes and dtypes, in `convert`'s order."""
        if not self.active:
            return params
        out = []
        for kind, what, p in self._walk(((p.name, p) for p in params), lambda p: p):
            if kind == "pass":
                out.append(ParamInfo(what, p.shape, p.dtype))
            else:
                out += [ParamInfo(f"{what.out}.{r}", p[r].shape, p[r].dtype)
                        for r in ("weight", "bias") if r in p]
        return out

    def convert(self, tensors: Iterable[tuple[str, Gathered]]) -> Iterator[tuple[str, Gathered]]:
        """(checkpoint name, tensor), in `plan` order; merged weights are new
        tensors (the gathered ones are only read)."""
        if not self.active:
            yield from tensors
            return
        for kind, what, x in self._walk(self._materialized(tensors), _copy):
            if kind == "pass":
                yield what, x
            else:
                yield from _merged(what, x)

    def _materialized(self, tensors: Iterable[tuple[str, Gathered]]
                      ) -> Iterator[tuple[str, Gathered]]:
        # Row blocks are drawn before the next gather: a piece is joined now.
        for name, t in tensors:
            if isinstance(t, RowBlocks) and self._route(name)[0] == "piece":
                t = t.materialize()
            yield name, t


def _copy(t: Gathered) -> Gathered:
    return t.clone() if isinstance(t, torch.Tensor) else t


def _shared_params(root: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _kept_child(w: Any) -> str:
    """The child of a ModulesToSaveWrapper its forward runs (and
    merge_and_unload() keeps), as a name prefix."""
    active = w.active_adapters
    if w.disable_adapters or not active or any(a not in w._adapters for a in active):
        return "original_module."
    return f"modules_to_save.{active[0]}."


def _delta(lora: _Lora, a: str, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """PEFT's get_delta_weight(): the factors' dtype (B's for Linear, A's for
    Embedding), float32 on the CPU for half-precision factors."""
    dtype = A.dtype if lora.embedding else B.dtype
    fp32 = B.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if fp32:
        A, B = A.float(), B.float()
    d = B @ A
    if lora.embedding or lora.fan_in_fan_out:
        d = d.T
    d = d * lora.scaling[a]
    return d.to(dtype) if fp32 else d


def _merged(lora: _Lora, got: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT's merge(safe_merge=False), adapter after adapter, out of place:
    `W += delta` computes in the promoted dtype and rounds to W's once."""
    w = got["weight"]
    bias = got.get("bias")
    for a in lora.adapters:
        d = _delta(lora, a, got[f"A.{a}"], got[f"B.{a}"])
        if lora.embedding:
            d = d.to(w.dtype)  # Embedding.merge() casts the delta first
        w = (w + d).to(w.dtype)
        if lora.lora_bias[a]:
            assert bias is not None
            bias = (bias + got[f"Bb.{a}"] * lora.scaling[a]).to(bias.dtype)
    yield f"{lora.out}.weight" if lora.out else "weight", w
    if bias is not None:
        yield f"{lora.out}.bias" if lora.out else "bias", bias
