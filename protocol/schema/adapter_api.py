"""Wire types of a LoRA adapter push (pydantic only).

An adapter push is a push like any other (begin, buckets, prepare, commit,
probe), whose `BeginRequest.adapter` says its tensors are a LoRA adapter:
`<module>.lora_A.weight` ([r, in]) and `<module>.lora_B.weight` ([out, r]) for
modules whose `<module>.weight` the served checkpoint holds, in the serving
dtype. The server builds the adapter in memory and serves it for this
version; requests name no adapter (the newest committed version's is used).

`scaling` is the trainer's own number per module (PEFT's `layer.scaling`,
alpha/r or alpha/sqrt(r) with rslora, rank and alpha patterns applied): the
server multiplies `B @ A` by exactly that, once, instead of re-deriving it
from a config (SkyRL 2221: a rebuilt adapter scaled twice).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from rollout_sidecar.protocol.schema.fields import Int, StrictModel, not_null

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
Scaling = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def lora_module(name: str) -> tuple[str, str] | None:
    """("<module>", "A" | "B") of an adapter tensor's wire name, else None."""
    for suffix, factor in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], factor
    return None


class AdapterSpec(StrictModel):
    """What makes a push an adapter push."""

    scaling: dict[str, Scaling] = Field(
        min_length=1, description="Per adapted module (checkpoint name, e.g. "
        "`model.layers.0.self_attn.q_proj`): the factor `B @ A` is multiplied by in the "
        "trainer's forward. Every module here sends both factors, and only these do.")
    base_version: Int | None = Field(
        None, json_schema_extra=not_null,
        description="The version of the full weights the adapter applies to; it must be "
        "the one this replica holds (`WeightStatus.lora.base_version`), else 409. Absent: "
        "the push carries those weights too (every checkpoint tensor, loaded first).")

    @property
    def with_base(self) -> bool:
        """The push carries the full weights too (it names no `base_version`)."""
        return self.base_version is None


class LoraStatus(BaseModel):
    """A server started with LoRA enabled (`--enable-lora`)."""

    max_rank: int = Field(description="The largest adapter rank it accepts.")
    keep: int = Field(description="Adapter versions kept loaded, so that requests admitted "
                      "under an older one finish on it.")
    base_version: int = Field(description="The version whose full weights the model holds "
                              "(0: the checkpoint): the base an adapter-only push must name.")
    adapters: list[int] = Field(description="Versions loaded as adapters, oldest first.")
    serving_adapter: bool = Field(description="The served version is an adapter over "
                                  "`base_version` (false: plain full weights).")
