"""A dense step is found on a sample, before the full diff
(trainer/delta/early_sample.py). The oracle is the full diff itself
(ShardCopy.diff, then choose_forms and worth_it, as a push plans): the
sample's estimate goes dense early only where the full diff would have gone
dense too, and never where a delta is worth sending; and it reads a few
percent of the elements the diff reads."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_sidecar.trainer.delta import early_sample
from rollout_sidecar.trainer.delta.early_sample import (
    EARLY_DENSE,
    estimated_share,
    sample_changes,
)
from rollout_sidecar.trainer.delta.patch_gather import DeltaDiff
from rollout_sidecar.trainer.delta.patch_plan import choose_forms, worth_it
from rollout_sidecar.trainer.delta.shard_copy import ShardCopy
from rollout_sidecar.trainer.delta.shard_pieces import Piece

WIRE = torch.bfloat16
DENSE_ABOVE = 0.25


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(1000, 256, generator=g), "w": torch.randn(512, 256, generator=g),
            "norm": torch.randn(256, generator=g), "tiny": torch.randn(7, generator=g)}


def stepped(m: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """`share` of every tensor's elements moved, enough to change their bf16 bits."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + (torch.rand(t.shape, generator=g) < share) * t.abs().clamp(min=1e-3) * 0.5
            for n, t in m.items()}


def plan(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
         ) -> tuple[float, str | None, int]:
    """(the sample's estimate, the full diff's reason to go dense (None: a
    delta), elements the sample compared)."""
    copy = ShardCopy()
    names = list(before)
    copy.refresh([Piece(n, 0, t.reshape(-1)) for n, t in before.items()], [WIRE] * len(names), 1)
    diff = DeltaDiff([Piece(n, 0, t.reshape(-1)) for n, t in after.items()], copy, names,
                     DENSE_ABOVE)
    shapes = [tuple(t.shape) for t in after.values()]
    sampled = diff.sampled()
    share = estimated_share(sampled, shapes, [WIRE] * len(names), DENSE_ABOVE)
    plans = choose_forms(names, shapes, [WIRE] * len(names), diff.stats(), DENSE_ABOVE)
    return share, worth_it(plans, DENSE_ABOVE, 1 << 30), int(sampled[..., 0].sum())


@pytest.mark.parametrize("moved, early", [(1.0, True), (0.9, True), (0.4, True), (0.25, None),
                                          (0.15, False), (0.01, False), (0.0, False)])
def test_the_sample_goes_dense_only_where_the_full_diff_would(moved: float, early: bool | None
                                                              ) -> None:
    m = model()
    share, full_why, seen = plan(m, stepped(m, moved, seed=1))
    if share > EARLY_DENSE:  # never a delta the full diff would have sent
        assert full_why is not None, (share, full_why)
    if early:  # a dense step: decided on the sample, as the full diff decides it
        assert share > EARLY_DENSE, share
    elif early is False:  # a delta is worth sending: the sample leaves it to the full diff
        assert share < 0.5 and full_why is None, (share, full_why)
    numel = sum(t.numel() for t in m.values())
    assert seen <= 0.35 * numel  # small tensors are read whole; the 256K embedding is not


def test_a_piece_is_sampled_in_evenly_spread_blocks() -> None:
    n = early_sample.BLOCKS * early_sample.BLOCK * 10
    base = torch.zeros(n, dtype=WIRE)
    new = base.clone()
    new[-1] = 1  # the last element: the last block ends there
    seen, changed = sample_changes(Piece("t", 0, new), base)
    assert (seen, changed) == (early_sample.BLOCKS * early_sample.BLOCK, 1)
    new[n // 2 + early_sample.BLOCK * 3] = 1  # between blocks: not seen
    assert sample_changes(Piece("t", 0, new), base) == (seen, 1)
    small = torch.ones(100, dtype=torch.float32)  # a piece in the trainer's dtype: cast first
    assert sample_changes(Piece("s", 0, small), torch.ones(100, dtype=WIRE)) == (100, 0)


def test_the_estimate_prices_each_tensor_as_the_plan_would() -> None:
    shapes, dtypes = [(1000,), (10,)], [WIRE, WIRE]
    none = torch.tensor([[[1000, 0], [10, 0]]])
    assert estimated_share(none, shapes, dtypes, DENSE_ABOVE) == 0.0
    every = torch.tensor([[[1000, 1000], [10, 10]]])
    assert estimated_share(every, shapes, dtypes, DENSE_ABOVE) == 1.0
    # Two ranks' samples add up per tensor: 30% of the first changed, dense; the second not.
    split = torch.tensor([[[500, 100], [5, 0]], [[500, 200], [5, 0]]])
    assert math.isclose(estimated_share(split, shapes, dtypes, DENSE_ABOVE), 2000 / 2020)
