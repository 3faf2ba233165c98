"""The TRL integration's pure parts (trainer/integrations/trl.py): no server,
no trainer run. The real GRPOTrainer runs are tests/integrations/test_trl.py."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import pytest
from torch import nn

from rollout_sidecar.trainer.integrations.trl import SidecarRollout, repeats
from rollout_sidecar.trainer.integrations.trl_trainer import (
    fsdp_fallback,
    push_target,
    unsupported_sampling,
)
from tests import processes


def trainer(temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
            generation_kwargs=None):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repetition_penalty=repetition_penalty,
                           args=SimpleNamespace(generation_kwargs=generation_kwargs),
                           accelerator=SimpleNamespace(is_main_process=True))


def test_import_needs_no_trl():
    code = ("import sys, rollout_sidecar.trainer.integrations.trl; "
            "assert not {'trl', 'transformers'} & set(sys.modules), 'imported eagerly'")
    assert processes.run([sys.executable, "-c", code], timeout_s=120).returncode == 0


def test_repeats_groups_equal_neighbours():
    # TRL repeats each prompt num_generations times; a group may straddle ranks.
    assert repeats([[1], [1], [1], [2], [2], [1]]) == [(0, 3), (3, 2), (5, 1)]
    assert repeats([[5, 6]]) == [(0, 1)]


@pytest.mark.parametrize("mode, t, ok", [
    ("processed_logprobs", trainer(temperature=0.7, top_k=5), True),
    ("raw_logprobs", trainer(), True),  # raw == processed when sampling is unmodified
    ("raw_logprobs", trainer(temperature=0.7), False),
    ("raw_logprobs", trainer(top_p=0.9), False),
    ("raw_logprobs", trainer(top_k=20), False),
])
def test_logprobs_mode_against_sampling(mode, t, ok):
    r = SidecarRollout("http://127.0.0.1:1")
    r.logprobs_mode = mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if ok:
            r._check_logprobs(t, correct=True)
            return
        # With TRL's correction on, a biased ratio is an error naming the fix...
        with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
            r._check_logprobs(t, correct=True)
    # ...and with it off, a warning.
    with pytest.warns(UserWarning, match="--logprobs-mode processed_logprobs"):
        r._check_logprobs(t, correct=False)


def test_sampling_the_server_cannot_apply():
    assert unsupported_sampling(trainer()) == []
    assert unsupported_sampling(trainer(generation_kwargs={"stop": ["\n"]})) == []
    bad = unsupported_sampling(trainer(min_p=0.1, repetition_penalty=1.1,
                                        generation_kwargs={"seed": 1}))
    assert len(bad) == 3


def test_push_target_unwraps_data_parallel_only():
    m = nn.Linear(2, 2)
    assert push_target(SimpleNamespace(model_wrapped=m)) is m
    assert push_target(SimpleNamespace(model_wrapped=nn.DataParallel(m))) is m


@pytest.mark.parametrize("env, fsdp_arg, ran, warns", [
    ("true", [], "MULTI_CPU", True),     # accelerate launch with an FSDP config, on CPU
    ("false", ["full_shard"], "MULTI_CPU", True),  # TrainingArguments(fsdp=...)
    ("true", [], "FSDP", False),          # on a GPU: FSDP ran
    ("false", [], "MULTI_CPU", False),    # DDP asked, DDP ran
])
def test_fsdp_that_accelerate_turned_into_ddp_is_named(monkeypatch, env, fsdp_arg, ran, warns):
    """A stand-in trainer (SimpleNamespace) with accelerate's own DistributedType."""
    from accelerate.utils import DistributedType

    monkeypatch.setenv("ACCELERATE_USE_FSDP", env)
    t = SimpleNamespace(args=SimpleNamespace(fsdp=fsdp_arg),
                        accelerator=SimpleNamespace(distributed_type=DistributedType[ran]),
                        model_wrapped=nn.parallel.DistributedDataParallel.__new__(
                            nn.parallel.DistributedDataParallel))
    msg = fsdp_fallback(t)
    assert (msg is not None) == warns
    if warns:
        assert "runs MULTI_CPU (DistributedDataParallel)" in msg and "fully_shard" in msg
