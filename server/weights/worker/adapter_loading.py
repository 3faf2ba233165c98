"""Build a pushed LoRA adapter from staged tensors and serve it (vLLM worker).

vLLM loads an adapter from a path on disk the first time a request names it,
and again whenever it dropped it: its LRU cache evicts, and every weight
update session's end removes every adapter (`reset_lora_state`, which also
runs after our commits). Our adapters' paths point nowhere (`SCHEME`):
`_load_adapter` builds them from the factors the push carried, kept here per
LoRA id (`_PUSHED`) for the ids the API process keeps (engine/adapter_table.py),
with `LoRAModel.from_lora_tensors`.

Scaling (SkyRL 2221: an adapter rebuilt after eviction was scaled twice):
vLLM multiplies `B` by the scaling in place when it registers an adapter
(`LoRALayerWeights.optimize`), so every build starts from clones of the
factors as pushed, which never change, and sets the trainer's own per-module
scaling from the push (adapter_api.py) once; nothing derives it again from
alpha and r. Each push's commit rebuilds its adapter at its first request,
so the tests' oracle checks go through a rebuild every time.

Refused at the commit's load, before anything changes (LoadRefused, the model
untouched): a server without --enable-lora, a rank over --max-lora-rank, a
module vLLM does not apply LoRA to in this model (it would be dropped
silently, and the served model would lack that part of the adapter), and
LoRA on the head or the embeddings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from rollout_sidecar.protocol.failpoints import fire
from rollout_sidecar.protocol.schema.adapter_api import lora_module
from rollout_sidecar.server.weights.worker.reload import LoadRefused

log = logging.getLogger(__name__)

SCHEME = "rollout-sidecar://"  # as engine/adapter_table.py names our adapters
PEFT_PREFIX = "base_model.model."  # the names vLLM's LoRA parser expects
# Not served as LoRA here (see `_head_without_lora`): such models push merged.
HEAD_AND_EMBEDDINGS = {"lm_head", "embed_tokens", "wte", "word_embeddings"}


def split_adapter(tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(the base weights, in order; the adapter's factors by wire name)."""
    base, factors = [], {}
    for name, t in tensors:
        if lora_module(name) is None:
            base.append((name, t))
        else:
            factors[name] = t
    return base, factors


def _manager(model: torch.nn.Module) -> Any:
    manager = getattr(model, "lora_manager", None)  # set by vLLM's LoRAModelManager
    if manager is None:
        raise LoadRefused("this server was started without --enable-lora: it cannot serve "
                          "a LoRA adapter")
    return manager


def _expected_modules(manager: Any) -> set[str]:
    """Module names (last component) vLLM applies LoRA to in this model, as
    its own `WorkerLoRAManager._load_adapter` computes them."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    return expected - HEAD_AND_EMBEDDINGS


def build_adapter(model: torch.nn.Module, factors: dict[str, torch.Tensor],
                  scaling: dict[str, float], lora_id: int) -> Any:
    """A vLLM `LoRAModel` of the pushed factors, not yet registered."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = _manager(model)
    ranks: dict[str, int] = {}
    for name, t in factors.items():
        module, factor = lora_module(name)  # type: ignore[misc]
        if factor == "A":
            ranks[module] = t.shape[0]
    rank = max(ranks.values())
    if rank > manager.lora_config.max_lora_rank:
        raise LoadRefused(f"adapter rank {rank} is over this server's --max-lora-rank "
                          f"{manager.lora_config.max_lora_rank}")
    expected = _expected_modules(manager)
    unsupported = sorted(m for m in ranks if m.rsplit(".", 1)[-1] not in expected)
    if unsupported:
        raise LoadRefused(f"vLLM applies no LoRA to {unsupported[:4]} in this model (it "
                          f"adapts {sorted(expected)}); push the merged model instead")
    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank,
                                   "target_modules": sorted({m.rsplit('.', 1)[-1]
                                                             for m in ranks})})
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    # Cloned: vLLM scales B in place when it registers the adapter.
    named = {PEFT_PREFIX + n: t.detach().clone() for n, t in factors.items()}
    lora = LoRAModel.from_lora_tensors(lora_id, named, helper, device="cpu",
                                       dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size,
                                       weights_mapper=mapper)
    for wire, module in ((n, lora_module(n)[0]) for n in factors):  # type: ignore[index]
        vllm_name, _ = parse_fine_tuned_lora_name(PEFT_PREFIX + wire, mapper)
        layer = lora.loras[vllm_name]
        layer.rank = ranks[module]
        layer.scaling = scaling[module]
        if layer.lora_a is None or layer.lora_b is None:
            raise LoadRefused(f"{module}: the adapter needs both lora_A and lora_B")
    return lora


# lora id -> (the factors as pushed, the scaling per module): what every
# build of that adapter starts from. vLLM drops every adapter when a weight
# update session ends (`reset_lora_state`) and evicts from its LRU cache;
# either way it loads the adapter again through `_load_adapter`, which for
# ours builds it from here.
_PUSHED: dict[int, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}


def stage_adapter(model: torch.nn.Module, factors: dict[str, torch.Tensor],
                  scaling: dict[str, float], lora_id: int, keep_ids: list[int]) -> None:
    """Build the adapter once (every refusal happens here, before the
    commit), then keep its factors for vLLM's loads; drop ids not kept."""
    if fire("adapter.scaling_twice") is not None:
        scaling = {m: s * s for m, s in scaling.items()}
    build_adapter(model, factors, scaling, lora_id)
    for old in [i for i in _PUSHED if i not in keep_ids]:
        del _PUSHED[old]
    _PUSHED[lora_id] = ({n: t.detach().clone() for n, t in factors.items()}, dict(scaling))
    log.info("staged LoRA adapter id %d (%d factors); kept ids %s", lora_id, len(factors),
             sorted(_PUSHED))


def patch_vllm_lora() -> None:
    """In each worker process, once: our adapters load from `_PUSHED`, and
    the head's logits skip the LoRA path (`_head_without_lora`)."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, "_rollout_sidecar", False):
        return
    LogitsProcessorWithLoRA._get_logits = _head_without_lora  # type: ignore[method-assign]

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        if not str(lora_request.lora_path).startswith(SCHEME):
            return original(self, lora_request)
        pushed = _PUSHED.get(lora_request.lora_int_id)
        if pushed is None:
            raise RuntimeError(f"LoRA adapter {lora_request.lora_name} was dropped from this "
                               "server (past --lora-keep with no request holding it)")
        return build_adapter(self._adapter_manager.model, *pushed, lora_request.lora_int_id)

    _load_adapter._rollout_sidecar = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]


def _head_without_lora(self: Any, hidden_states: torch.Tensor, lm_head: Any,
                       embedding_bias: torch.Tensor | None = None, skip_gather: bool = False
                       ) -> torch.Tensor | None:
    """The head's logits as without LoRA. Our adapters never adapt the head
    (`build_adapter` refuses it), so vLLM's LoRA add there is a zero; and on
    CPU it fails for prompt logprobs of several sequences at once (its
    per-request indices against per-token hidden states: an einsum error
    that kills the engine)."""
    return self.base_layer._get_logits(hidden_states, getattr(lm_head, "base_layer", lm_head),
                                       embedding_bias, skip_gather)
