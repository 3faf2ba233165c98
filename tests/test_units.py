"""Unit tests of pure pieces (no engine, no network)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout_sidecar.protocol.schema import GenerateRequest, SamplingConfig
from rollout_sidecar.server.engine.version_gate import MinVersionTimeout, VersionGate
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo, meta_modules, param_plan
from rollout_sidecar.trainer.gather.names import normalize_name
from rollout_sidecar.trainer.pack.buckets import ALIGN, plan_buckets


@pytest.mark.parametrize("raw, clean", [
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.weight",
     "model.layers.0.mlp.weight"),
    ("module._orig_mod.lm_head.weight", "lm_head.weight"),
    ("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight",
     "model.layers.1.self_attn.q_proj.weight"),
    ("model.module_list.0.weight", "model.module_list.0.weight"),  # only a leading "module."
])
def test_normalize_name(raw, clean):
    assert normalize_name(raw) == clean


def test_buckets_respect_size_alignment_and_order():
    params = [ParamInfo(f"p{i}", (1000 + i,), torch.float32) for i in range(50)]
    buckets = plan_buckets(params, torch.bfloat16, bucket_bytes=10_000)
    names = [s.name for b in buckets for s in b.params]
    assert names == [p.name for p in params]
    for b in buckets:
        assert b.nbytes <= 10_000
        assert all(s.offset % ALIGN == 0 for s in b.params)
        ends = [s.offset + s.length for s in b.params]
        assert all(e <= s2.offset for e, s2 in zip(ends, b.params[1:], strict=False))


def test_tied_weights_are_planned_once_and_meta_is_found():
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    m[1].weight = m[0].weight
    assert [p.name for p in param_plan(m)] == ["0.weight"]
    assert meta_modules(m) == []
    with torch.device("meta"):
        m.append(torch.nn.Linear(4, 4))
    assert meta_modules(m) == ["2"]


def test_sampling_range_errors_name_the_field():
    assert SamplingConfig(top_p=0).range_error()[0] == "sampling.top_p"
    assert SamplingConfig().range_error() is None
    with pytest.raises(ValueError):
        GenerateRequest(prompts=["a"], prompt_token_ids=[[1]])


def test_version_gate_waits_for_min_version_and_holds_during_commit():
    async def run():
        gate = VersionGate(0)
        with pytest.raises(MinVersionTimeout):
            await gate.admit(1, timeout_s=0.05)
        waiter = asyncio.create_task(gate.admit(1, timeout_s=5))
        async with gate.commit_window("wait", drain_s=1) as mode:
            assert mode == "wait"
            blocked = asyncio.create_task(gate.admit(None, timeout_s=5))
            await asyncio.sleep(0.05)
            assert not blocked.done()  # nobody is admitted mid-swap
            await gate.publish(1)
        assert (await waiter).version == 1 and (await blocked).version == 1
        # A request from 0 that finished under 1 got no tokens from 1 after a
        # wait commit (it was drained first); after keep commits it ran on.
        assert gate.versions_between(0, 1) == [0]
        await gate.publish(2, "keep")
        await gate.publish(3, "keep")
        await gate.publish(4, "abort")
        assert gate.versions_between(1, 3) == [1, 2, 3]
        assert gate.versions_between(2, 4) == [2, 3]

    asyncio.run(run())


def test_wait_commit_drains_admitted_requests_then_falls_back_to_abort():
    """The drain covers requests vLLM would leave queued: everything admitted."""
    async def run():
        gate = VersionGate(0)
        quick, slow = await gate.admit(None, 1), await gate.admit(None, 1)
        quick.submitted(), slow.submitted()
        asyncio.get_running_loop().call_later(0.05, quick.finished)
        async with gate.commit_window("wait", drain_s=0.3) as mode:
            assert mode == "abort"  # `slow` never finished within the bound
        slow.finished()
        async with gate.commit_window("wait", drain_s=0.3) as mode:
            assert mode == "wait" and gate.in_flight == 0
        lease = await gate.admit(None, 1)
        lease.submitted()
        async with gate.commit_window("keep", drain_s=5) as mode:
            assert mode == "keep" and gate.in_flight == 1  # keep lets it run on
        lease.finished()
        lease.finished()  # idempotent

    asyncio.run(run())


def test_a_commit_never_pauses_the_engine_with_a_submission_on_its_way():
    """vLLM 0.33 refuses a request that reaches a paused engine
    (`engine_paused`; 0.32 queued it): a commit whose drain bound passes with
    a submission still pending fails before any pause, and admissions reopen."""
    from rollout_sidecar.server.engine.version_gate import SubmissionsStuck

    async def run():
        gate = VersionGate(0)
        stuck = await gate.admit(None, 1)  # admitted, never submitted (a wedged engine)
        paused = []
        with pytest.raises(SubmissionsStuck, match="nothing was loaded"):
            async with gate.commit_window("wait", drain_s=0.2):
                paused.append(True)  # where the commit would pause the engine
        assert not paused
        stuck.submitted()
        stuck.finished()
        lease = await gate.admit(None, 1)  # open again
        assert lease.version == 0

    asyncio.run(run())


def test_a_broken_gate_refuses_until_a_version_is_published():
    from rollout_sidecar.server.errors import ServiceUnavailable

    async def run():
        gate = VersionGate(3)
        gate.broken = "load failed"
        with pytest.raises(ServiceUnavailable):
            await gate.admit(None, 1)
        await gate.publish(4)
        assert (await gate.admit(None, 1)).version == 4

    asyncio.run(run())


def test_manifest_check_refuses_partial_wrong_shape_and_dtype():
    from rollout_sidecar.protocol.schema import BeginRequest
    from rollout_sidecar.server.errors import BadRequest
    from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
    from rollout_sidecar.server.weights.manifest_check import check_manifest

    index = CheckpointIndex({"a": TensorSpec((4,), "bfloat16"), "b": TensorSpec((2, 2),
                                                                               "bfloat16")},
                            tie_word_embeddings=False)

    def req(params, nbytes=64 * 2):
        return BeginRequest(version=1, buckets=[{"index": 0, "nbytes": nbytes, "params": params}])

    a = {"name": "a", "dtype": "bfloat16", "shape": [4], "offset": 0}
    b = {"name": "b", "dtype": "bfloat16", "shape": [2, 2], "offset": 64}
    check_manifest(req([a, b]), index, "bfloat16")  # complete and right: accepted
    # A bucket is its slots padded to the alignment at most: no bytes nothing reads.
    with pytest.raises(BadRequest) as e:
        check_manifest(req([a, b], nbytes=64 * 3), index, "bfloat16")
    assert e.value.field == "buckets[0].nbytes" and "may be 128 at most" in str(e.value)
    for params, field in [([a], "buckets"),  # partial (a alone: 64 bytes): would zero fused layers
                          ([a, dict(b, shape=[4])], "buckets[0].params[1].shape"),
                          ([a, dict(b, dtype="float32")], "buckets[0].params[1].dtype"),
                          ([a, dict(b, name="c")], "buckets[0].params[1].name")]:
        with pytest.raises(BadRequest) as e:
            check_manifest(req(params, 64 * len(params)), index, "bfloat16")
        assert e.value.field == field
    # No bucket at all: only a delta of unchanged weights (its base, relabelled).
    unchanged = BeginRequest(version=2, buckets=[], delta_base=1)
    check_manifest(unchanged, index, "bfloat16")
    assert unchanged.unchanged and not req([a, b]).unchanged
    with pytest.raises(BadRequest) as e:
        check_manifest(BeginRequest(version=2, buckets=[]), index, "bfloat16")
    assert e.value.field == "buckets"


def test_every_setting_is_a_serve_flag_with_its_env_var_and_default():
    from unittest import mock

    from pydantic import SecretStr
    from typer.testing import CliRunner

    import rollout_sidecar.server.cli as cli
    from rollout_sidecar.server.config import ServerSettings

    help_text = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "1000"}).output
    for name, field in ServerSettings.model_fields.items():
        secret = SecretStr in getattr(field.annotation, "__args__", (field.annotation,))
        flag, env = "--" + name.replace("_", "-"), "ROLLOUT_SIDECAR_" + name.upper()
        # Tokens: environment only (the help names their variables, never a flag).
        assert (flag in help_text) != secret and env in help_text, name
    assert "default: 30.0" in help_text and "default: wait" in help_text
    seen = {}
    with mock.patch("rollout_sidecar.server.serve.run_server", lambda s: seen.update(s=s)):
        r = CliRunner().invoke(cli.app, ["serve", "--commit-policy", "keep", "--no-enforce-eager",
                                         "--openai-args=--tool-call-parser hermes",
                                         "--logprobs-mode", "processed_logprobs"])
    assert r.exit_code == 0, r.output
    s = seen["s"]
    assert (s.commit_policy, s.enforce_eager, s.openai_args) == ("keep", False,
                                                                 "--tool-call-parser hermes")
    assert s.logprobs_mode == "processed_logprobs" and "default: raw_logprobs" in help_text
