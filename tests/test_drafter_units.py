"""A speculative drafter pushed with the target: the parts, without vLLM.
The served proof is tests/e2e/test_drafter.py. No fake engine here: these
are the server's manifest check and drafter record, the worker's split and
the trainer's gather order, each on its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from rollout_sidecar.protocol.schema import DRAFT_PREFIX, BeginRequest, CommitResponse
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine.drafter import Drafter
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.metrics.collectors import Acceptance
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.server.weights.manifest_check import carries_draft, check_manifest
from rollout_sidecar.server.weights.worker.draft_loading import draft_load, split_draft
from rollout_sidecar.server.weights.worker.reload import LoadRefused
from rollout_sidecar.trainer.draft_push import (
    converted_target,
    draft_buffers,
    draft_plan,
    with_draft,
)
from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors
from rollout_sidecar.trainer.push_result import drafter_outcome

TARGET = CheckpointIndex({"w": TensorSpec((4, 4), "float32"), "b": TensorSpec((4,), "float32")},
                         tie_word_embeddings=False)
DRAFT = CheckpointIndex({"w": TensorSpec((2, 4), "float32")}, tie_word_embeddings=False)
INDEX = TARGET.with_draft(DRAFT)


def begin(names: list[str]) -> BeginRequest:
    slots, offset = [], 0
    for name in names:
        spec = INDEX.tensors[name]
        slots.append({"name": name, "dtype": "float32", "shape": list(spec.shape),
                      "offset": offset})
        offset += 4 * spec.numel
    return BeginRequest(version=1, transport="http",
                        buckets=[{"index": 0, "nbytes": offset, "params": slots}])


def test_the_index_names_the_drafters_tensors_apart():
    assert INDEX.draft == {"draft.w"}
    assert INDEX.tensors["draft.w"].shape == (2, 4) and INDEX.tensors["w"].shape == (4, 4)
    assert TARGET.with_draft(None) is TARGET


def test_a_push_carries_every_drafter_tensor_or_none():
    check_manifest(begin(["w", "b"]), INDEX, "float32")  # the drafter frozen
    check_manifest(begin(["w", "b", "draft.w"]), INDEX, "float32")  # synced
    assert not carries_draft(begin(["w", "b"])) and carries_draft(begin(["w", "b", "draft.w"]))
    two = CheckpointIndex({"w": TensorSpec((4, 4), "float32"), "v": TensorSpec((2,), "float32")},
                          tie_word_embeddings=False)
    index = TARGET.with_draft(two)
    with pytest.raises(BadRequest, match="missing draft.v") as e:  # half a drafter
        check_manifest(BeginRequest(version=1, transport="http", buckets=[
            {"index": 0, "nbytes": 64 + 64 + 16, "params": [
                {"name": "w", "dtype": "float32", "shape": [4, 4], "offset": 0},
                {"name": "b", "dtype": "float32", "shape": [4], "offset": 64},
                {"name": "draft.w", "dtype": "float32", "shape": [4, 4], "offset": 80}]}]),
            index, "float32")
    assert e.value.field == "buckets"


def test_drafter_tensors_to_a_server_without_one_are_refused_by_name():
    with pytest.raises(BadRequest, match="no drafter that takes pushes") as e:
        check_manifest(begin(["w", "b", "draft.w"]), TARGET, "float32")
    assert e.value.field == "buckets[0].params[2].name"


def test_the_drafter_record_says_frozen_until_a_push_carries_it():
    acc = Acceptance()
    d = Drafter({"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 3},
                INDEX, acc)
    assert d.status(0).synced and d.pushable and d.status(0).acceptance is None
    acc.add(10, 7)
    assert d.status(0).acceptance == 0.7
    assert d.committed(1, carried=False) == "frozen"
    st = d.status(1)
    assert (st.version, st.synced, st.draft_tokens) == (0, False, 0)  # reset at the commit
    assert d.relabeled(1, 2) == "frozen"  # unchanged weights: still the old drafter
    assert d.committed(3, carried=True) == "synced" and d.status(3).synced
    assert d.relabeled(3, 4) == "synced" and d.status(4).version == 4
    assert not Drafter({"method": "ngram"}, TARGET, acc).pushable


def test_speculative_config_is_a_json_object():
    spec = '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}'
    assert ServerSettings(speculative_config=spec).speculative["num_speculative_tokens"] == 3
    for bad in ("{", "[1]", '{"num_speculative_tokens": 3}'):
        with pytest.raises(ValidationError) as e:
            ServerSettings(speculative_config=bad)
        assert e.value.errors()[0]["loc"] == ("speculative_config",)
    assert ServerSettings(speculative_config="").speculative is None  # compose's unset


def test_the_worker_splits_the_staged_copy_and_refuses_without_a_drafter():
    t = torch.zeros(1)
    target, draft = split_draft([("w", t), ("draft.w", t), ("b", t)])
    assert [n for n, _ in target] == ["w", "b"] and [n for n, _ in draft] == ["w"]
    assert draft_load(None, []) is None
    with pytest.raises(LoadRefused, match="runs no drafter"):
        draft_load(None, draft)
    load = draft_load((nn.Linear(1, 1), object()), draft)
    assert load is not None and load.weights == draft


def test_the_drafter_is_gathered_after_the_target_and_skips_its_conversion():
    target, draft = nn.Linear(3, 2), nn.Linear(3, 1, bias=False)
    names = [n for n, _ in with_draft(iter_full_tensors(target), draft, None, [])]
    assert names == ["weight", "bias", DRAFT_PREFIX + "weight"]
    assert [p.name for p in draft_plan(draft, [])] == [DRAFT_PREFIX + "weight"]
    # The same module as its own drafter: gathered twice, in that order.
    names = [n for n, _ in with_draft(iter_full_tensors(target), target, None, [])]
    assert names == ["weight", "bias", "draft.weight", "draft.bias"]

    def upper(ts):  # a conversion that would break the drafter's names
        return ((n.upper(), t) for n, t in ts)

    out = converted_target(with_draft(iter_full_tensors(target), draft, None, []), upper)
    assert [n for n, _ in out] == ["WEIGHT", "BIAS", "draft.weight"]
    out = converted_target(iter_full_tensors(target), upper)  # no drafter
    assert [n for n, _ in out] == ["WEIGHT", "BIAS"]


def test_a_push_result_is_frozen_if_any_replica_kept_an_old_drafter():
    def reply(drafter):
        return CommitResponse(weight_version=1, push_id="p", commit_policy="wait", timings={},
                              drafter=drafter)
    assert drafter_outcome([reply(None)]) is None
    assert drafter_outcome([reply("synced"), reply("synced")]) == "synced"
    assert drafter_outcome([reply("synced"), reply("frozen")]) == "frozen"


def test_a_drafter_push_to_a_replica_without_one_is_refused_naming_it():
    ok, plain = SimpleNamespace(capabilities=["senders", "draft"]), SimpleNamespace(
        capabilities=["senders"])
    draft = nn.BatchNorm1d(2)  # persistent buffers: running_mean, running_var, ...
    index = ["draft.running_mean", "draft.weight"]
    assert draft_buffers(draft, ["http://a"], [ok], index) == ["running_mean"]
    with pytest.raises(ValueError, match="http://b run no drafter"):
        draft_buffers(draft, ["http://a", "http://b"], [ok, plain], index)
