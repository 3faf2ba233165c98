"""Load staged tensors into the live vLLM model: all of it, or none of it.

vLLM's layerwise reload (`vllm.model_executor.model_loader.reload`) puts every
layer back into checkpoint layout on the meta device, buffers the loader calls,
and processes a layer (materialise, load, repack, copy into the live kernel
tensors) as soon as all of its elements arrived. Two of its behaviours would
let a push commit while the model serves something else:

- A layer that receives nothing is "placed back" with a log warning, so a
  skipped or mis-mapped tensor leaves old weights in place and the commit
  still succeeds.
- A tied `lm_head` never receives anything (its weight is the embedding's), so
  its post-load processing never re-runs. On CPU that processing prepacks the
  head for oneDNN, so the head kept multiplying by the *old* embedding while
  its `Parameter` already held the new one. A checksum of the parameters would
  have passed; the served logprobs were 0.05-0.5 nats off.
- MoE experts: on a weight update vLLM skips the experts kernel's own
  `process_weights_after_loading` ("the kernel does not need to be re-built"),
  but on CPU that step prepacks w13/w2 into the grouped-GEMM layout. The new,
  unpacked experts were copied into storage the kernel reads as packed: every
  push served garbage experts (Qwen3-MoE, GLM-4.5: 0.13 nats off with the
  weights unchanged). Such layers are processed as on a first load.

So here processing is deferred until `load_weights` has returned, and the
element counts vLLM keeps for every layer are checked first. If any layer with
parameters is short, every layer is put back as it was (nothing was copied into
the live tensors yet) and the push fails with the layers named. Tied aliases
are recognised by parameter identity and re-processed after the load.

A speculative drafter (draft_loading.py) loads in the same call: both models
are counted before either is written, so a drafter that would be short
leaves the target untouched too.

Tied to vLLM 0.32's private reload internals; pyproject pins `<0.33`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rollout_sidecar.protocol.failpoints import fire

if TYPE_CHECKING:
    from vllm.config import ModelConfig

log = logging.getLogger(__name__)


class LoadRefused(RuntimeError):
    """The load was refused before any live tensor changed. vLLM's
    `update_weights` re-raises it as it is in the worker, where
    worker_calls.py turns it into the reply's typed `untouched` field."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"[model untouched] {reason}")


@dataclass
class ReloadReport:
    layers: int = 0
    elements: int = 0
    tied: list[str] = field(default_factory=list)


def _param_numel(layer: torch.nn.Module) -> int:
    """Elements a full push writes into the layer's parameters, in checkpoint
    layout (the restored meta tensors; live ones may be repacked or emptied)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    total = 0
    shards = getattr(layer, "shard_indices", None)  # a vocab-parallel embedding or head
    for name, p in layer._parameters.items():
        if p is None or name in SKIP_LOAD_TENSORS:
            continue
        if name == "weight" and shards is not None and p.dim() == 2:
            # Rows padding the vocabulary to a multiple of 64 are never loaded.
            total += (shards.num_org_elements + shards.num_added_elements) * p.shape[1]
        else:
            total += get_tensor_load_numel(p)
    return total


@contextlib.contextmanager
def _deferred_processing(deferred: list) -> Iterator[None]:
    """Hold back vLLM's per-layer processing (which writes the live tensors)."""
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise._layerwise_process
    layerwise._layerwise_process = lambda layer, info: deferred.append((layer, info))
    try:
        yield
    finally:
        layerwise._layerwise_process = original


@contextlib.contextmanager
def _skipping(names: dict[int, str], skip: str | None) -> Iterator[Any]:
    """vLLM's per-layer processing, except for the layer a test names (the
    `quant.skip` failpoint), which keeps its live, previous-version tensors:
    a reload that skips re-quantizing. Patched where vLLM looks it up, so the
    layers vLLM itself processes at the end are covered too."""
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise._layerwise_process
    if not skip:
        yield original
        return

    def process(layer: torch.nn.Module, info: Any) -> None:
        if names.get(id(layer)) == skip:
            layerwise._place_kernel_tensors(layer, info)
            return
        original(layer, info)

    layerwise._layerwise_process = process
    try:
        yield process
    finally:
        layerwise._layerwise_process = original


def _snapshot_unmanaged(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the live tensors vLLM's reload loads in place, bypassing the
    deferral (its SKIP_LOAD_TENSORS: expert maps, router score biases). They
    are small (one value per expert)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return [(t, t.detach().clone()) for m in model.modules()
            for n, t in [*m._parameters.items(), *m._buffers.items()]
            if n in SKIP_LOAD_TENSORS and t is not None]


@contextlib.contextmanager
def _as_first_load(layer: torch.nn.Module) -> Iterator[None]:
    """On CPU, make an MoE layer re-run its experts kernel's setup (prepack).

    vLLM rebuilds the kernel only when `moe_kernel` is None; on CUDA it keeps
    the kernel on purpose (captured graphs), and its unquantized experts have
    nothing to prepack, so this applies to CPU only.
    """
    from vllm.model_executor.layers.fused_moe.modular_kernel import (
        FusedMoEExperts,
    )
    from vllm.platforms import current_platform

    method = getattr(layer, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    hook = getattr(type(experts), "process_weights_after_loading", None)
    if (not current_platform.is_cpu() or experts is None
            or hook is FusedMoEExperts.process_weights_after_loading):
        yield
        return
    assert method is not None  # it has a kernel
    method.moe_kernel = None
    try:
        yield
    except BaseException:
        method.moe_kernel = kernel
        raise


def _restore_untouched(model: torch.nn.Module,
                       unmanaged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put every layer's live tensors back; used when nothing was processed."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LOADING_LAYERS,
        _get_original_loader,
        _place_kernel_tensors,
        get_layerwise_info,
    )

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load() and info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
            # Tensors that never went to meta (biases) kept vLLM's loader wrapper.
            for t in [*layer._parameters.values(), *layer._buffers.values()]:
                if t is not None and hasattr(t, "weight_loader"):
                    t.weight_loader = _get_original_loader(t)
        info.reset()
    for live, saved in unmanaged:
        live.data.copy_(saved)
    LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _classify(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Module], int]:
    """(short layers, tied aliases, elements loaded) from vLLM's counters."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    names = {id(m): n or "<root>" for n, m in model.named_modules(remove_duplicate=False)}
    loaded_params: set[int] = set()
    empty: list[tuple[torch.nn.Module, Any]] = []
    short: list[str] = []
    elements = 0
    for layer in model.modules():
        info = get_layerwise_info(layer)
        need = _param_numel(layer) if info.can_load() else 0
        if need == 0 or is_deferred_attention_layer(layer):
            continue
        elements += info.load_numel
        if info.load_numel >= need:
            loaded_params |= {id(p) for p in info.kernel_tensors[0].values()}
        elif info.load_numel == 0:
            empty.append((layer, info))
        else:
            short.append(f"{names[id(layer)]} ({info.load_numel} of {need} elements)")
    tied = []
    for layer, info in empty:
        if {id(p) for p in info.kernel_tensors[0].values()} <= loaded_params:
            tied.append(layer)  # every parameter is another loaded layer's
        else:
            short.append(f"{names[id(layer)]} (0 of {_param_numel(layer)} elements)")
    return short, tied, elements


@dataclass
class _Staged:
    """One model's load, its weights taken in and counted, its live tensors
    not yet written: `apply` writes them, `abandon` puts every layer back."""

    model: torch.nn.Module
    model_config: Any
    unmanaged: list[tuple[torch.Tensor, torch.Tensor]]
    deferred: list[tuple[torch.nn.Module, Any]]
    tied: list[torch.nn.Module]
    elements: int

    def abandon(self) -> None:
        _restore_untouched(self.model, self.unmanaged)

    def apply(self) -> ReloadReport:
        """Process every layer into the live tensors (past the point of no return)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import (
            _place_kernel_tensors,
            get_layerwise_info,
        )

        model, tied = self.model, self.tied
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        skip = fire("quant.skip")  # a test's un-requantized layer (failpoints.py)
        with _skipping(names, skip) as process:
            for layer, info in self.deferred:
                # A skipped layer keeps its kernel too: it is not set up again.
                with contextlib.nullcontext() if names[id(layer)] == skip else \
                        _as_first_load(layer):
                    process(layer, info)
            for layer in tied:
                info = get_layerwise_info(layer)
                _place_kernel_tensors(layer, info)
                info.reset()
            # What vLLM processes itself at the end (attention, layers with padding
            # never loaded) goes through `process` too.
            finalize_layerwise_reload(model, self.model_config)
        for layer in tied:
            # Rebuild what processing derives from the (now updated) shared weight,
            # e.g. the CPU oneDNN prepack of a tied lm_head.
            method = getattr(layer, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(layer)
        report = ReloadReport(layers=len(self.deferred), elements=self.elements,
                              tied=[names[id(m)] for m in tied])
        log.info("reloaded %d layers, %d elements; re-processed tied %s", report.layers,
                 report.elements, report.tied or "none")
        return report


def _stage(model: torch.nn.Module, model_config: ModelConfig,
           weights: Iterable[tuple[str, torch.Tensor]], what: str) -> _Staged:
    """Take `weights` into `model`'s reload buffers; raise `LoadRefused`, the
    model as it was, if a layer would be short or vLLM's loader refuses."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    unmanaged = _snapshot_unmanaged(model)
    initialize_layerwise_reload(model)
    deferred: list[tuple[torch.nn.Module, Any]] = []
    try:
        with _deferred_processing(deferred):
            model.load_weights(weights)
        short, tied, elements = _classify(model)
    except BaseException as e:
        _restore_untouched(model, unmanaged)
        raise LoadRefused(f"vLLM's loader rejected the push{what}: {e}") from e
    if short:
        _restore_untouched(model, unmanaged)
        more = f" and {len(short) - 6} more" if len(short) > 6 else ""
        raise LoadRefused(f"layers{what} would keep stale weights: {'; '.join(short[:6])}{more}")
    return _Staged(model, model_config, unmanaged, deferred, tied, elements)


@dataclass(frozen=True)
class DraftLoad:
    """The speculative drafter's model and the weights it takes in the same load."""

    model: torch.nn.Module
    model_config: Any
    weights: Iterable[tuple[str, torch.Tensor]]


def load_all_or_nothing(model: torch.nn.Module, model_config: ModelConfig,
                        weights: Iterable[tuple[str, torch.Tensor]],
                        draft: DraftLoad | None = None) -> ReloadReport:
    """Load `weights` (checkpoint names and layout) into the live model, and
    `draft`'s into the drafter: both, or neither.

    Raises `LoadRefused` (both models untouched) if any layer with
    parameters would not be fully written, or if vLLM's loaders reject a
    tensor. Both are counted before either is written.
    """
    target = _stage(model, model_config, weights, "")
    drafter = None
    if draft is not None:
        try:
            drafter = _stage(draft.model, draft.model_config, draft.weights, " (drafter)")
        except BaseException:
            target.abandon()
            raise
    # From here on the live tensors change.
    report = target.apply()
    if drafter is not None:
        drafter.apply()
    return report
