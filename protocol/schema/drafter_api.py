"""Wire types of a speculative drafter kept in sync (pydantic only).

A server started with `--speculative-config` (vLLM's flag) runs a drafter
beside the target. When the drafter has a checkpoint of its own (vLLM's
`draft_model` method, or an EAGLE head), `GET /weights/index` lists its
tensors under `DRAFT_PREFIX` (`draft.model.layers.0...`, vLLM's own prefix
for a drafter's parameters) and the server offers the `DRAFT` capability. A
push then carries either every one of them (the drafter is loaded in the same
commit as the target: one pause, one version, all or nothing) or none (the
drafter keeps its weights: *frozen*, and every reply says since which version).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout_sidecar.protocol.schema.fields import ReplyModel

DRAFT_PREFIX = "draft."
DRAFT = "draft"  # the capability: pushes may carry the drafter's tensors
# What a commit did to the drafter: loaded with the target, or left as it was.
DraftOutcome = Literal["synced", "frozen"]


def is_draft(name: str) -> bool:
    """A wire name of one of the drafter's tensors."""
    return name.startswith(DRAFT_PREFIX)


class DrafterStatus(ReplyModel):
    """The server's drafter (`/info`, `/weights/status`)."""

    method: str = Field(description="vLLM's speculative method (`draft_model`, `eagle`, "
                        "`ngram`, ...).")
    model: str | None = Field(description="The drafter's checkpoint, if it has one.")
    num_speculative_tokens: int
    pushable: bool = Field(description="Pushes may carry its weights: it has a checkpoint of "
                           "its own, indexed under `draft.` (`GET /weights/index`). Otherwise "
                           "it never changes (an n-gram drafter has no weights).")
    version: int = Field(description="The weight version whose push last loaded the drafter "
                         "(0: its checkpoint's weights, as at start).")
    synced: bool = Field(description="The drafter's weights came with the served version's "
                         "push. False: frozen at `version` while the target moved on; "
                         "acceptance falls, output stays exact (speculation is lossless).")
    draft_tokens: int = Field(description="Tokens drafted since the served version was "
                              "committed.")
    accepted_tokens: int = Field(description="Of those, tokens the target accepted.")
    acceptance: float | None = Field(description="accepted_tokens / draft_tokens, or null "
                                     "before the first draft.")
