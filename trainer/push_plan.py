"""One push's plan: what it carries, and why, decided once on every rank.

Rank 0 reads the servers at the push's start (`Opening`: served dtype, the
base a delta may name, the adapter spec), and every rank receives it; every
rank then diffs its own shard when a delta may go (a collective). From there
on each rank holds the same `PushPlan`, and the rest of the push (begin, the
gathers and sends, the result) reads it instead of asking again which kind of
push this is. The server reads the same decision off the wire's
`BeginRequest` (`delta_base`, `adapter`, `adapter_only`).

Encodings:
- dense: every checkpoint tensor, whole (also a PEFT model merged, or a
  model whose checkpoint layout is converted);
- delta: each rank's changed elements against `delta_base`, the version
  every replica's staged copy and every rank's shard copy hold;
- adapter: LoRA factors over the full weights every replica holds;
- adapter+base: the factors and every checkpoint tensor.

`drained` is the discipline every rank follows while rank 0 sends: the
gathers are collectives, so each rank runs every one of them, in order, even
after rank 0 hit an error (the error is agreed on at the commit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from rollout_sidecar.protocol.schema import AdapterSpec
from rollout_sidecar.trainer.delta.delta_push import DeltaPlan
from rollout_sidecar.trainer.push_opening import Opening
from rollout_sidecar.trainer.push_result import Encoding

T = TypeVar("T")


@dataclass(frozen=True)
class PushPlan:
    opening: Opening  # rank 0's reading of the servers, the same on every rank
    delta: DeltaPlan | None  # the diff's plan when the push goes as a delta
    why_dense: str | None  # when it does not, why
    # Why each rank cannot send its own FSDP2 rows (gather/own_rows.py), any
    # rank's; None: it can, where several ranks send and every replica takes them.
    why_gathered: str | None = "not asked"

    @property
    def encoding(self) -> Encoding:
        if self.delta is not None:
            return "delta"
        if self.adapter is not None:
            return "adapter+base" if self.adapter.with_base else "adapter"
        return "dense"

    @property
    def adapter(self) -> AdapterSpec | None:
        return self.opening.adapter

    @property
    def delta_base(self) -> int | None:
        return self.delta.base if self.delta is not None else None

    @property
    def sends_buffers(self) -> bool:
        """Persistent buffers travel with every push that carries the full weights."""
        return self.encoding != "adapter"


@contextmanager
def drained(gathers: Iterator[T]) -> Iterator[Iterator[T]]:
    """Yield `gathers`; on the way out, normal or not, run whatever is left
    of it, so this rank takes part in every collective the others run."""
    try:
        yield gathers
    finally:
        for _ in gathers:
            pass
