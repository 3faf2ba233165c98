"""A push from named tensors: what RL frameworks hand over instead of a module.

verl's FSDP actor yields `(HF name, full tensor)` on every rank, one
all-gather per tensor (`get_per_tensor_param()`); other loops hold a state
dict on rank 0. `WeightPusher.push_tensors` takes either, and everything
after the gathers is the module path's: the same buckets, checks, senders,
two-phase commit and probe.

The one thing a stream does not say up front is its order, and the manifest
is laid out at begin, before the first tensor is drawn. So the layout comes
from the served index (names, shapes, dtypes: what a push must carry) in an
order that is a guess the first time (`first_push_order`: the checkpoint's
names in module order as far as names show it) and, from then on, the order
this stream yielded them last time. A tensor that arrives before its turn is
held until its bucket is packed: a correct push whatever the order, and, in
the order learned, holds nothing (`held_bytes` in the result says what the
first one held). The stream is checked as it goes: a name the served model
does not have, a shape it does not have, a tensor that never came or came
twice fails the push by name before anything is published.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable
from dataclasses import dataclass

import torch

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.schema import WeightIndex
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo
from rollout_sidecar.trainer.gather.names import normalize_name

Named = Iterable[tuple[str, torch.Tensor]]
TIED_HEAD = "lm_head.weight"  # a tied model's state dict has it; its checkpoint does not


@dataclass
class NamedTensors:
    """One push's tensors. `every_rank`: every rank yields every tensor, in
    the same order (each may be a collective, as verl's are), so every rank
    can send its share; otherwise rank 0's alone are read."""

    tensors: Named | None
    every_rank: bool = True


def _natural(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p]


def first_push_order(names: Iterable[str]) -> list[str]:
    """Names in module order as far as names show it: layer 2 before layer
    10, and heads outside the body's top-level module (`lm_head`, `score`)
    after it, where `state_dict()` puts them. Within a layer the order is
    alphabetical, so the first push holds at most about a layer."""
    names = list(names)
    tops = [n.split(".", 1)[0] for n in names]
    body = max(set(tops), key=tops.count) if tops else ""
    return sorted(names, key=lambda n: (n.split(".", 1)[0] != body, _natural(n)))


@dataclass
class NamedLayout:
    """A pusher's memory of its stream's order (one per pusher: a stream's
    order is its model's, the same every push)."""

    order: list[str] | None = None
    held_bytes: int = 0  # the last push's most bytes held at once

    def plan(self, index: WeightIndex) -> list[ParamInfo]:
        """What a push must carry (drafter tensors aside: a stream has the
        policy's), in the order this stream is expected to yield it."""
        wanted = {n for n in index.tensors if n not in set(index.draft)}
        learned = [n for n in self.order or () if n in wanted]
        order = learned + first_push_order(wanted - set(learned))
        return [ParamInfo(n, tuple(index.tensors[n].shape), torch_dtype(index.tensors[n].dtype))
                for n in order]

    def ordered(self, source: NamedTensors, plan: list[str], index: WeightIndex
                ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """`source`'s tensors in `plan`'s order; the stream is drawn to its end
        whatever happens (its tensors may be collectives), and its order kept
        for the next push."""
        stream = iter(source.tensors or ())
        held: dict[str, torch.Tensor] = {}
        seen: list[str] = []
        skip = set(index.ignored)
        if index.tie_word_embeddings and TIED_HEAD not in index.tensors:
            skip.add(TIED_HEAD)
        self.held_bytes = held_now = 0
        whole = False  # the stream checked to its end: its order is worth keeping
        try:
            for want in plan:
                while want not in held:
                    try:
                        name, t = next(stream)
                    except StopIteration:
                        missing = [n for n in plan if n not in seen]
                        raise KeyError(f"the tensors ended without {len(missing)} the served "
                                       f"checkpoint has: {missing[:8]}") from None
                    name = normalize_name(name)
                    if name in skip:
                        continue
                    t = _checked(name, t, index, seen)
                    seen.append(name)
                    held[name] = t
                    held_now += t.numel() * t.element_size()
                self.held_bytes = max(self.held_bytes, held_now - _nbytes(held[want]))
                t = held.pop(want)
                held_now -= _nbytes(t)
                yield want, t
            for name, t in stream:  # anything after the last planned tensor
                name = normalize_name(name)
                if name not in skip:
                    _checked(name, t, index, seen)
            whole = True
        finally:
            self.order = seen if whole else self.order
            for _ in stream:  # the rest of the collectives, on an error
                pass


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _checked(name: str, t: torch.Tensor, index: WeightIndex, seen: list[str]) -> torch.Tensor:
    info = index.tensors.get(name)
    if info is None or name in index.draft:
        raise KeyError(f"{name!r} is not a tensor of the served model (GET /weights/index "
                       "lists what a push carries)")
    if name in seen:
        raise KeyError(f"{name!r} came twice")
    if hasattr(t, "full_tensor"):  # a DTensor: its all-gather, on every rank in step
        t = t.full_tensor()
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device: materialise it before pushing")
    if list(t.shape) != info.shape:
        raise ValueError(f"{name} has shape {list(t.shape)}; the served model's is {info.shape}")
    return t.detach()
