"""Where a receiver's buckets land, asked by the relays as they go.

A relay (`bucket_group.relay_buckets` for gloo, `chain_steps.relay_steps` for
NCCL) used to take every bucket's buffer up front, so each bucket had memory
of its own for the whole push. A bucket whose bytes belong in several places
(chunks of tensors split across buckets: server staging.py) needs a buffer
only while it arrives and goes on to the next rank; the relay asks for it
when it posts the bucket's first receive (`buffer`, or `pieces`: where
each piece lands, which need not be one buffer), hands over each piece
in order as it lands (`piece`), and says when the bucket has also left for
the next rank (`passed_on`), after which the buffer may be reused. A relay
never holds more than its window of buckets at once, so a receiver that
lends buffers holds that many, not the push.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rollout_sidecar.protocol.data_plane.bucket_pieces import even


class Landing(Protocol):
    """A receiver's buckets, in manifest order."""

    def buffer(self, k: int) -> torch.Tensor:
        """Where bucket `k` arrives: asked once, before its first piece
        (NCCL's fused steps)."""
        ...

    def pieces(self, k: int) -> list[torch.Tensor]:
        """Where each of bucket `k`'s pieces arrives, in order: asked once,
        before the first (gloo's chain; bucket_pieces.py cuts them)."""
        ...

    def piece(self, k: int, piece: torch.Tensor) -> None:
        """Bucket `k`'s next piece is here (its pieces come in order)."""
        ...

    def passed_on(self, k: int) -> None:
        """Bucket `k` is all here and forwarded: its buffer is free again."""
        ...


class InPlace:
    """Buckets that each have a buffer of their own (a bench, a test, a
    receiver whose buffers are its staged copy)."""

    def __init__(self, buffers: Sequence[torch.Tensor],
                 on_piece: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.buffers = buffers
        self.on_piece = on_piece

    def buffer(self, k: int) -> torch.Tensor:
        return self.buffers[k]

    def pieces(self, k: int) -> list[torch.Tensor]:
        return even(self.buffers[k])

    def piece(self, k: int, piece: torch.Tensor) -> None:
        if self.on_piece is not None:
            self.on_piece(k, piece)

    def passed_on(self, k: int) -> None:
        pass
