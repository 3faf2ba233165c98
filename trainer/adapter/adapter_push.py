"""The pusher's adapter step: choose the form of a PEFT model's push, and
after a commit, remember which base every replica holds.

`WeightPusher(adapter="auto")` (the default) sends a PEFT LoRA model as its
adapter when every replica was started with --enable-lora, accepts its rank,
and the model is one the server can apply as vLLM LoRA (lora_adapter.py);
else the model goes merged, as before, and `PushResult.adapter_reason` says
why. Why automatic: the served function is the same either way (the fp32
oracle proves it), and an adapter is 0.1-1% of the model's bytes.
`adapter=True` raises instead of falling back; `False` always merges.

The base: an adapter applies to the full weights a replica holds. This
trainer knows them to be its model's base only for a version it pushed with
the base (`with_base`) and that every replica still reports as its
`lora.base_version`; otherwise (the first push, a restart, a merged or
another trainer's full push in between) the push carries the base too, as
one atomic version.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rollout_sidecar.protocol.schema import AdapterSpec, WeightStatus
from rollout_sidecar.protocol.schema.adapter_api import LORA_A
from rollout_sidecar.trainer.adapter.lora_adapter import LoraAdapter
from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.gather.full_tensors import param_plan


class AdapterPushError(WeightPushError):
    """`adapter=True`, but this model or these servers cannot take an adapter push."""


class AdapterPush:
    def __init__(self, mode: str | bool) -> None:
        self.mode = mode
        self.base: int | None = None  # a version every replica got this model's base at

    def choose(self, model: nn.Module, statuses: Sequence[WeightStatus], urls: Sequence[str],
               requested: bool | None) -> tuple[AdapterSpec | None, str | None]:
        """(the adapter push's spec, None) or (None, why it goes merged).
        Rank 0 only."""
        mode = self.mode if requested is None else requested
        if mode is False:
            return None, None
        lora = LoraAdapter(model)
        if lora.refusal == "not a PEFT model" and mode != True:  # noqa: E712 ("auto")
            return None, None
        why = lora.refusal or self._servers_refuse(model, lora, statuses, urls)
        if why is not None:
            if mode is True:
                raise AdapterPushError(f"adapter=True, but cannot push an adapter: {why}")
            return None, f"pushed merged: {why}"
        base = self.base if self.base is not None and all(
            st.lora is not None and st.lora.base_version == self.base for st in statuses) \
            else None
        return lora.spec(base), None

    @staticmethod
    def _servers_refuse(model: nn.Module, lora: LoraAdapter, statuses: Sequence[WeightStatus],
                        urls: Sequence[str]) -> str | None:
        rank = max(p.shape[0] for p in lora.plan(param_plan(model), with_base=False)
                   if p.name.endswith(LORA_A))
        for url, st in zip(urls, statuses, strict=True):
            if st.lora is None:
                return f"{url} was started without --enable-lora"
            if rank > st.lora.max_rank:
                return f"rank {rank} is over {url}'s --max-lora-rank {st.lora.max_rank}"
        return None

    def committed(self, spec: AdapterSpec | None, version: int) -> None:
        """Every replica committed `version`, pushed with `spec` (None: full)."""
        if spec is None:
            self.base = None  # merged or plain weights: not this model's base
        elif spec.with_base:
            self.base = version
