"""A speculative drafter pushed in the same push as the policy.

`WeightPusher.push(model, version, draft=...)` sends the drafter's tensors
after the target's, under `draft.` names (protocol/schema/drafter_api.py),
in the same buckets, checks and commit: the server loads both in one pause
or neither. `draft` is a second module (an EAGLE head or a small draft model
trained beside the policy, or distilled from it) or `model` itself (a drafter
that is a copy of the target): its gathers run after the target's, on every
rank, in the same order. A push without `draft` leaves the server's drafter
as it was, and the result says so (`PushResult.drafter == "frozen"`).

MTP heads are not covered: they are layers of the policy's own checkpoint
(DeepSeek-V3's `model.layers.{num_hidden_layers}`, Qwen3-Next's `mtp.*`),
which vLLM's MTP drafter reads from the target's checkpoint, so the server
would have to route those names to the drafter (docs/fast-rollouts.md).

A push with a drafter goes dense: a delta or an adapter covers the target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from rollout_sidecar.protocol.schema import DRAFT, DRAFT_PREFIX, WeightStatus, is_draft
from rollout_sidecar.trainer.gather.full_tensors import (
    ParamInfo,
    iter_full_tensors,
    param_plan,
    persistent_buffers,
)

Gathered = tuple[str, Any]  # (name, a tensor or RowBlocks)


def draft_buffers(draft: nn.Module, urls: Sequence[str], statuses: Sequence[WeightStatus],
                  index: Iterable[str]) -> list[str]:
    """The drafter's persistent buffers the served drafter checkpoint holds
    (their own names); raise, naming them, if a replica takes no drafter."""
    lacking = [u for u, st in zip(urls, statuses, strict=True) if DRAFT not in st.capabilities]
    if lacking:
        raise ValueError(f"draft: {', '.join(lacking)} run no drafter that takes pushes (serve "
                         "--speculative-config with a drafter checkpoint of its own)")
    names = set(index)
    return sorted(n for n in persistent_buffers(draft) if DRAFT_PREFIX + n in names)


def draft_plan(draft: nn.Module, buffers: Sequence[str]) -> list[ParamInfo]:
    """The drafter's entries of the manifest, after the target's."""
    return [ParamInfo(DRAFT_PREFIX + p.name, p.shape, p.dtype)
            for p in param_plan(draft, buffers)]


def with_draft(target: Iterator[Gathered], draft: nn.Module | None, device: Any,
               buffers: Sequence[str], block_bytes: int | None = None) -> Iterator[Gathered]:
    """Every rank: the target's gathers, then the drafter's (`draft.` names)."""
    yield from target
    if draft is not None:
        for name, t in iter_full_tensors(draft, device, buffers, block_bytes):
            yield DRAFT_PREFIX + name, t


def converted_target(gathers: Iterator[Gathered],
                     convert: Callable[[Iterable[Gathered]], Iterator[Gathered]]
                     ) -> Iterator[Gathered]:
    """`convert` (a PEFT merge, a checkpoint layout) applied to the target's
    tensors alone; the drafter's pass as they are, after them."""
    first_draft: list[Gathered] = []

    def target() -> Iterator[Gathered]:
        for item in gathers:
            if is_draft(item[0]):
                first_draft.append(item)
                return
            yield item

    yield from convert(target())
    yield from first_draft
    yield from gathers
