"""Validate an adapter push's factors against the served checkpoint, before
any bytes move (manifest_check.py calls this for every `*.lora_A/B.weight`).

Each factor must belong to a module the checkpoint holds a 2-D weight of and
the push's `adapter.scaling` names: lora_A is [r, in], lora_B is [out, r],
with the module's own in and out, the same r for both, and r at most the
server's --max-lora-rank. Every module in `scaling` sends both factors.
"""

from __future__ import annotations

from rollout_sidecar.protocol.schema import AdapterSpec, TensorSlot
from rollout_sidecar.protocol.schema.adapter_api import lora_module
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec


class AdapterFactors:
    """The factors seen so far in one manifest, checked one slot at a time."""

    def __init__(self, spec: AdapterSpec, index: CheckpointIndex, serve_dtype: str,
                 max_rank: int) -> None:
        self.spec = spec
        self.index = index
        self.serve_dtype = serve_dtype
        self.max_rank = max_rank
        self.ranks: dict[str, dict[str, int]] = {}  # module -> {"A": r, "B": r}

    def slot_spec(self, p: TensorSlot, f: str) -> TensorSpec | None:
        """The shape and dtype this factor must have; None if `p` is no factor."""
        parsed = lora_module(p.name)
        if parsed is None:
            return None
        module, factor = parsed
        if module not in self.spec.scaling:
            raise BadRequest(f"{p.name}: module {module!r} is not in adapter.scaling",
                             f"{f}.name")
        weight = self.index.tensors.get(f"{module}.weight")
        if weight is None or len(weight.shape) != 2:
            raise BadRequest(f"{p.name}: the served checkpoint has no 2-D {module}.weight to "
                             "adapt (check name normalisation)", f"{f}.name")
        out, inp = weight.shape
        if len(p.shape) != 2:
            raise BadRequest(f"{p.name}: a LoRA factor is 2-D, not {list(p.shape)}", f"{f}.shape")
        r = p.shape[0] if factor == "A" else p.shape[1]
        if not 1 <= r <= self.max_rank:
            raise BadRequest(f"{p.name}: rank {r} is outside 1..{self.max_rank} (this "
                             "server's --max-lora-rank)", f"{f}.shape")
        self.ranks.setdefault(module, {})[factor] = r
        return TensorSpec((r, inp) if factor == "A" else (out, r), self.serve_dtype)

    def finish(self) -> None:
        for module in self.spec.scaling:
            got = self.ranks.get(module, {})
            if set(got) != {"A", "B"}:
                raise BadRequest(f"adapter.scaling names {module!r}, but the push carries "
                                 f"{sorted(got) or 'no'} factors of it (both lora_A and "
                                 "lora_B are needed)", "adapter.scaling")
            if got["A"] != got["B"]:
                raise BadRequest(f"{module}: lora_A has rank {got['A']}, lora_B {got['B']}",
                                 "buckets")
