"""The probe's forward runs while the commit is in flight (trainer/probe.py,
`commit_with_forward`), one process, no server: the commit is a plain
function here. What a user relies on: the two overlap, the commit's error
is the push's error, and a forward that fails is raised at the probe, after
the commit went through, as when the forward ran after it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.probe import commit_with_forward, probe_push

WAIT_S = 30  # far above either side's work; only a failure waits this long
SERVING = SimpleNamespace(vocab_size=32, max_model_len=64)


class Logits(nn.Module):
    """A causal LM in miniature: input ids in, logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


def test_the_forward_runs_while_the_commit_waits_for_the_servers():
    forward_ran, committed = threading.Event(), threading.Event()

    def commit() -> str:
        # The servers are loading: only a forward running meanwhile sets this.
        assert forward_ran.wait(WAIT_S), "the forward did not run during the commit"
        committed.set()
        return "committed"

    def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        assert not committed.is_set()
        forward_ran.set()
        return model(ids)

    model = Logits()
    outcome, forwarded = commit_with_forward(commit, model, SERVING, forward, None)
    assert outcome == "committed" and forwarded.error is None
    want = torch.log_softmax(model(torch.tensor([forwarded.token_ids]))[0, :-1], -1)
    want = want.gather(-1, torch.tensor(forwarded.token_ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(forwarded.logprobs), want)


def test_a_failed_commit_is_the_push_error_whatever_the_forward_did():
    def commit() -> None:
        raise WeightPushError("replica refused the commit")

    with pytest.raises(WeightPushError, match="refused the commit"):
        commit_with_forward(commit, Logits(), SERVING, True, None)


def test_a_forward_that_fails_is_raised_at_the_probe_after_the_commit():
    def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("this model's forward takes no input_ids")

    outcome, forwarded = commit_with_forward(lambda: "committed", Logits(), SERVING, forward,
                                             None)
    assert outcome == "committed"  # the commit's bookkeeping goes on first
    with pytest.raises(TypeError, match="no input_ids"):
        probe_push(forwarded, 1, None, None, None)
