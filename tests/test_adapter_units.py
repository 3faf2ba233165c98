"""Adapter pushes, unit level (no engine): which PEFT models go as an
adapter and what they send, the pusher's choice and base tracking against
replicas' statuses, the server's manifest check of adapter factors, and which
adapter versions a server keeps."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rollout_sidecar.protocol.schema import AdapterSpec, BeginRequest, LoraStatus, WeightStatus
from rollout_sidecar.server.engine.adapter_table import AdapterTable
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.trainer.adapter.adapter_push import AdapterPush, AdapterPushError
from rollout_sidecar.trainer.adapter.lora_adapter import LoraAdapter
from rollout_sidecar.trainer.gather.full_tensors import param_plan
from tests.test_peft_merge import LINEAR, llama


def lora(targets=LINEAR, r: int = 4, **kw) -> torch.nn.Module:
    return get_peft_model(llama(), LoraConfig(r=r, lora_alpha=8, target_modules=targets, **kw))


def test_a_plain_lora_model_sends_its_factors_under_checkpoint_names():
    model = lora(use_rslora=True)
    a = LoraAdapter(model)
    assert a.eligible, a.refusal
    only = a.plan(param_plan(model), with_base=False)
    block = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in LINEAR}
    assert {p.name for p in only} == {f"model.layers.{i}.{block[m]}.{m}.lora_{f}.weight"
                                      for i in range(2) for m in LINEAR for f in "AB"}
    q = next(p for p in only if p.name == "model.layers.0.self_attn.q_proj.lora_A.weight")
    assert q.shape == (4, 64)
    # PEFT's own scaling: rslora gives alpha / sqrt(r), not alpha / r
    assert a.scaling["model.layers.0.self_attn.q_proj"] == pytest.approx(8 / 4 ** 0.5)
    with_base = {p.name for p in a.plan(param_plan(model), with_base=True)}
    assert set(llama().state_dict()) <= with_base  # every checkpoint tensor, unmerged
    assert {p.name for p in only} <= with_base


@pytest.mark.parametrize("kw, why", [
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(targets=["lm_head"]), "output head"),
    (dict(targets=["embed_tokens"]), "embedding"),
    (dict(lora_bias=True), "lora_bias"),
])
def test_models_vllm_cannot_serve_as_an_adapter_go_merged(kw, why):
    a = LoraAdapter(lora(**kw))
    assert not a.eligible and why in a.refusal


def status(lora: LoraStatus | None) -> WeightStatus:
    return WeightStatus(weight_version=3, dtype="float32", vocab_size=96, max_model_len=64,
                        boot_id="b", push_state="idle", push_in_progress=False, connected=None,
                        data_plane_port=1, transports=["gloo"], push_timeout_s=1,
                        commit_drain_s=1, lora=lora)


def lora_on(base: int, max_rank: int = 16) -> LoraStatus:
    return LoraStatus(max_rank=max_rank, keep=2, base_version=base, adapters=[],
                      serving_adapter=False)


def test_the_pusher_sends_the_base_until_every_replica_holds_its_base():
    model, urls = lora(), ["http://a", "http://b"]
    push = AdapterPush("auto")
    spec, why = push.choose(model, [status(lora_on(0))] * 2, urls, None)
    assert why is None and spec.base_version is None  # first push: with the base
    push.committed(spec, 4)
    spec, _ = push.choose(model, [status(lora_on(4))] * 2, urls, None)
    assert spec.base_version == 4  # the adapter alone
    spec, _ = push.choose(model, [status(lora_on(4)), status(lora_on(0))], urls, None)
    assert spec.base_version is None  # b restarted: with the base again
    push.committed(None, 5)  # a merged push: the servers' weights are not the base
    spec, _ = push.choose(model, [status(lora_on(4))] * 2, urls, None)
    assert spec.base_version is None


def test_servers_that_cannot_take_the_adapter_fall_back_or_raise():
    model, urls = lora(r=32), ["http://a"]
    spec, why = AdapterPush("auto").choose(model, [status(None)], urls, None)
    assert spec is None and "--enable-lora" in why
    spec, why = AdapterPush("auto").choose(model, [status(lora_on(0, max_rank=16))], urls, None)
    assert spec is None and "rank 32" in why
    with pytest.raises(AdapterPushError, match="rank 32"):
        AdapterPush("auto").choose(model, [status(lora_on(0, 16))], urls, True)
    assert AdapterPush("auto").choose(llama(), [status(None)], urls, None) == (None, None)
    with pytest.raises(AdapterPushError, match="not a PEFT model"):
        AdapterPush(True).choose(llama(), [status(lora_on(0))], urls, None)


INDEX = CheckpointIndex({"model.q.weight": TensorSpec((32, 16), "float32"),
                         "model.k.weight": TensorSpec((8, 16), "float32")}, False)


def begin(params: list[tuple[str, list[int]]], scaling: dict, base: int | None = 0,
          delta_base: int | None = None) -> BeginRequest:
    slots, offset = [], 0
    for name, shape in params:
        slots.append({"name": name, "dtype": "float32", "shape": shape, "offset": offset})
        offset += 4 * shape[0] * shape[1]
    return BeginRequest(version=1, transport="http", buckets=[
        {"index": 0, "nbytes": offset, "params": slots}],
        adapter=AdapterSpec(scaling=scaling, base_version=base), delta_base=delta_base)


def test_adapter_manifests_are_checked_against_the_checkpoint():
    ok = [("model.q.lora_A.weight", [4, 16]), ("model.q.lora_B.weight", [32, 4])]
    check_manifest(begin(ok, {"model.q": 2.0}), INDEX, "float32", 16)  # the factors alone
    with pytest.raises(BadRequest, match="missing") as e:  # with the base: every tensor
        check_manifest(begin(ok, {"model.q": 2.0}, base=None), INDEX, "float32", 16)
    cases = [
        ([("model.q.lora_A.weight", [32, 16]), ("model.q.lora_B.weight", [32, 32])],
         "max-lora-rank", "buckets[0].params[0].shape"),
        ([("model.q.lora_A.weight", [4, 16]), ("model.q.lora_B.weight", [32, 8])],
         "rank", "buckets"),
        ([("model.q.lora_A.weight", [4, 16])], "lora_B", "adapter.scaling"),
        ([("model.q.lora_A.weight", [4, 15]), ("model.q.lora_B.weight", [32, 4])],
         "server expects", "buckets[0].params[0].shape"),
        ([("model.v.lora_A.weight", [4, 16])], "model.v", "buckets[0].params[0].name"),
    ]
    for params, text, field in cases:
        scaling = {"model.v": 1.0} if params[0][0].startswith("model.v") else {"model.q": 2.0}
        with pytest.raises(BadRequest, match=text) as e:
            check_manifest(begin(params, scaling), INDEX, "float32", 16)
        assert e.value.field == field, (params, e.value)


class _Settings:
    enable_lora, max_lora_rank, lora_keep = True, 16, 2


def test_a_server_keeps_the_newest_adapters_and_those_requests_hold():
    t = AdapterTable(_Settings(), "boot")
    ids = {}
    for v in (1, 2, 3, 4):
        new = t.new(v)
        keep = t.keep_ids(new, leased={1})  # a request admitted under v1 still runs
        t.published_adapter(new, keep, with_base=v == 1)
        ids[v] = new.lora_id
    assert sorted(t.loaded) == [1, 3, 4]  # keep=2, plus v1 held by a request
    assert len(set(ids.values())) == 4  # a fresh LoRA id (and name) per load
    assert t.request_for(4).lora_int_id == ids[4] and t.request_for(2) is None
    t.published_full(5)
    assert t.status().base_version == 5 and not t.status().serving_adapter


def test_the_server_refuses_adapters_it_cannot_apply_naming_the_field():
    """A server without --enable-lora, an adapter sent as a delta, and an
    adapter over a base this replica does not hold are refused at begin."""
    from types import SimpleNamespace

    from rollout_sidecar.server.errors import PushConflict
    from rollout_sidecar.server.weights.service import WeightService

    def check(settings, **kw) -> None:
        table = AdapterTable(settings, "boot")
        table.published_full(3)
        service = SimpleNamespace(engine=SimpleNamespace(adapters=table))
        req = begin([("model.q.lora_A.weight", [4, 16]), ("model.q.lora_B.weight", [32, 4])],
                    {"model.q": 2.0}, **kw)
        WeightService._check_adapter(service, req)

    off = SimpleNamespace(enable_lora=False, max_lora_rank=16, lora_keep=2)
    with pytest.raises(BadRequest, match="--enable-lora") as e:
        check(off, base=3)
    assert e.value.field == "adapter"
    with pytest.raises(BadRequest, match="never a delta") as e:
        check(_Settings(), base=3, delta_base=2)
    assert e.value.field == "delta_base"
    with pytest.raises(PushConflict, match="adapter.base_version 2"):
        check(_Settings(), base=2)
    check(_Settings(), base=3)  # the base it holds: accepted
    check(_Settings(), base=None)  # with the base weights: any base
