"""Units: vLLM's per-step labels as our per-token spans (engine/version_spans.py).

Fakes stand in for vLLM's `CompletionOutput` and `WeightVersionSpan` (plain
objects with their fields); the gate is the real `VersionGate`.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

from rollout_sidecar.protocol.schema import GenerateResponse, Sample, VersionSpan
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.engine.version_spans import sample_spans, versions_used


def gate_with(*commits: tuple[int, str]) -> VersionGate:
    gate = VersionGate(0)
    for version, mode in commits:
        asyncio.run(gate.publish(version, mode))
    return gate


def output(*spans: tuple[str, int, int], tokens: int | None = None) -> NS:
    n = tokens if tokens is not None else (spans[-1][2] if spans else 0)
    return NS(token_ids=list(range(n)),
              weight_versions=[NS(version=v, start=a, end=b) for v, a, b in spans])


def as_tuples(spans: list[VersionSpan] | None) -> list[tuple[int, int, int]] | None:
    return None if spans is None else [(s.version, s.start, s.end) for s in spans]


def test_keep_commits_split_a_sample_where_the_label_changed():
    gate = gate_with((1, "keep"), (2, "keep"))
    spans = sample_spans(output(("0", 0, 4), ("1", 4, 9), ("2", 9, 12)), 0, gate)
    assert as_tuples(spans) == [(0, 0, 4), (1, 4, 9), (2, 9, 12)]
    # Each span after a keep commit began with the engine prefilling everything again.
    assert [s.resumed for s in spans] == [False, True, True]


def test_an_adapter_only_commit_is_no_boundary_for_a_running_request():
    # Version 2 was an adapter-only commit (published as "wait", no pause): the
    # request admitted under 1 keeps version 1's adapter, whatever the label says.
    gate = gate_with((1, "keep"), (2, "wait"))
    spans = sample_spans(output(("1", 0, 5), ("2", 5, 8)), 1, gate)
    assert as_tuples(spans) == [(1, 0, 8)]


def test_a_request_queued_across_a_keep_commit_starts_on_the_new_version():
    gate = gate_with((1, "keep"))
    assert as_tuples(sample_spans(output(("1", 0, 6)), 0, gate)) == [(1, 0, 6)]


def test_no_tokens_is_an_empty_list_and_unknown_labels_are_none():
    gate = gate_with()
    assert sample_spans(NS(token_ids=[], weight_versions=None), 0, gate) == []
    assert sample_spans(NS(token_ids=[1], weight_versions=None), 0, gate) is None
    assert sample_spans(output(("default", 0, 3)), 0, gate) is None


def test_versions_used_are_the_versions_the_spans_name():
    a, b = [VersionSpan(version=3, start=0, end=2), VersionSpan(version=5, start=2, end=4)], []
    assert versions_used([a, b], 3) == [3, 5]
    assert versions_used([[]], 3) == [3]  # nothing sampled: the admission version
    assert versions_used([a, None], 3) is None


def test_a_sample_expands_its_spans_per_token():
    s = Sample(text="", token_ids=[7, 8, 9], finish_reason="length",
               weight_versions=[VersionSpan(version=1, start=0, end=1),
                                VersionSpan(version=2, start=1, end=3)])
    assert s.token_versions() == [1, 2, 2]
    assert Sample(text="", token_ids=[7], finish_reason="stop").token_versions() is None
    # The response's versions have one name: versions_used (weight_versions is
    # each sample's spans); a key it does not know is ignored.
    r = GenerateResponse.model_validate({
        "results": [], "weight_version": 4, "versions_used": [4, 5],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})
    assert r.versions_used == [4, 5] and "weight_versions" not in r.model_dump()


def test_a_keep_commit_restarts_only_the_runs_that_would_fall_past_their_bound():
    from rollout_sidecar.server.engine.request_tracking import RequestTracker, Track

    gate = VersionGate(3)
    tracker = RequestTracker(gate)
    free = Track(NS(), since=1)  # no bound
    strict = Track(NS(), max_lag=0, since=3)
    loose = Track(NS(), max_lag=1, since=3)
    older = Track(NS(), max_lag=1, since=2)
    done = Track(NS(), max_lag=0, since=3, finish_version=3)  # frozen before the publish
    tracker.watch_all([free, strict, loose, older, done])
    assert set(tracker.too_far_behind(4)) == {strict, older}
    assert strict.restart and older.restart and not loose.restart and not done.restart
    # A run already marked is not counted again by a second commit.
    assert set(tracker.too_far_behind(5)) == {loose}


def test_max_version_lag_is_a_non_negative_integer_and_results_say_their_restarts():
    import pytest
    from pydantic import ValidationError

    from rollout_sidecar.protocol.schema import GenerateRequest, PromptResult

    assert GenerateRequest(prompts=["x"], max_version_lag=0).max_version_lag == 0
    for bad in (-1, 1.5, True):  # null is as absent: no bound
        with pytest.raises(ValidationError, match="max_version_lag"):
            GenerateRequest.model_validate({"prompts": ["x"], "max_version_lag": bad})
    assert PromptResult(prompt_token_ids=[1], samples=[]).restarts == 0  # old servers
