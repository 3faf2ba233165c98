"""A PEFT model pushes as merged weights (trainer/gather/peft_merge.py): no
server. The pusher's own gather-and-send path packs the buckets into a
loopback transport; the bytes are compared with the oracle, PEFT's own
`merge_and_unload()` of a deep copy, never with our code. FSDP2 and FSDP1
are tests/test_peft_merge_fsdp.py; served logprobs are tests/e2e/test_peft_push.py."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rollout_sidecar.protocol.schema import BeginRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.trainer import WeightPushError
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import param_plan
from rollout_sidecar.trainer.gather.peft_merge import PeftMerge, PeftMergeError
from rollout_sidecar.trainer.pack.buckets import manifest, plan_buckets
from rollout_sidecar.trainer.probe import trainer_logprobs
from rollout_sidecar.trainer.push_sends import Begun
from rollout_sidecar.trainer.pusher import WeightPusher
from tests.row_blocks_worker import reassemble
from tests.test_split_buckets import LoopbackTransport

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET = 1 << 15  # 32 KiB: many buckets, the larger weights split across them

# A dense push with no buffers: what `_gather_and_send` is given (trainer/push_plan.py).
def _dense_plan():  # noqa: ANN202
    from rollout_sidecar.trainer.push_opening import Opening
    from rollout_sidecar.trainer.push_plan import PushPlan

    return PushPlan(Opening(False, "", {}, [], None, None), None, None)


DENSE = _dense_plan()


def llama(tied: bool = False, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype)


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """LoRA's B starts at zero (no delta): give every adapter tensor and every
    modules_to_save copy random values, so the merge matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)


def peft_llama(**lora) -> torch.nn.Module:
    """The issue's model: LoRA on every linear of a tiny untied Llama, plus a
    fully trained copy of lm_head (modules_to_save)."""
    cfg = dict(r=4, lora_alpha=8, target_modules=LINEAR, modules_to_save=["lm_head"])
    model = get_peft_model(llama(), LoraConfig(**{**cfg, **lora}))
    randomize_adapters(model)
    return model


def oracle(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own merge, of a copy."""
    return copy.deepcopy(model).merge_and_unload().state_dict()


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def push_loopback(model: torch.nn.Module, wire: torch.dtype = torch.float32
                  ) -> tuple[dict[str, torch.Tensor], list]:
    """The pusher's begin plan (as `_begin` builds it) and its own
    `_gather_and_send`, into a transport that keeps the bytes."""
    merge = PeftMerge(model)
    plan = CheckpointLayout(merge.base_model).plan(merge.plan(param_plan(model)))
    buckets = plan_buckets(plan, wire, BUCKET)
    pusher = WeightPusher("http://127.0.0.1:9", admin_token="t", probe=False)
    pusher.transport = LoopbackTransport()
    sent = pusher._gather_and_send(model, Begun(buckets, ["p"]), DENSE)
    assert sent.error is None, sent.error
    assert len(sent.checksums) == len(buckets) > 1
    return reassemble(buckets, pusher.transport.sent), buckets


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    worst = {n: (got[n].double() - want[n].double()).abs().max().item() for n in want
             if got[n].shape != want[n].shape or not torch.equal(got[n], want[n].to(got[n].dtype))}
    # PEFT's arithmetic, op for op: equal bit for bit on the same device.
    assert worst == {}, worst


def test_merged_push_equals_merge_and_unload_and_leaves_the_model_alone():
    model = peft_llama()
    before = snapshot(model)
    want = oracle(model)
    got, buckets = push_loopback(model)
    assert_same(got, want)
    # the checkpoint's names and shapes exactly: a plain Llama's state dict
    assert {n: tuple(t.shape) for n, t in got.items()} == \
        {n: tuple(t.shape) for n, t in llama().state_dict().items()}
    # ... and the server's manifest check accepts it
    index = CheckpointIndex({n: TensorSpec(tuple(t.shape), "float32") for n, t in want.items()},
                            tie_word_embeddings=False)
    check_manifest(BeginRequest(version=1, buckets=manifest(buckets)), index, "float32")
    # the LoRA delta and the modules_to_save copy changed what is sent
    base = model.get_base_model()
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base.model.layers[0].self_attn.q_proj.base_layer.weight)
    assert torch.equal(got["lm_head.weight"], base.lm_head.modules_to_save["default"].weight)
    assert not torch.equal(got["lm_head.weight"], base.lm_head.original_module.weight)
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m.merged for m in model.modules() if isinstance(m, LoraLayer))


def two_adapters() -> torch.nn.Module:
    """Two adapters active at once, each with its own rank, alpha and rslora."""
    model = get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=LINEAR))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=3, use_rslora=True,
                                           target_modules=["q_proj", "up_proj"]))
    model.base_model.set_adapter(["default", "second"])
    randomize_adapters(model)
    return model


def gpt2_fan_in_fan_out() -> torch.nn.Module:
    """GPT-2's Conv1D keeps weights (in, out): fan_in_fan_out transposes B @ A."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=2,
                                      n_head=4, tie_word_embeddings=False))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, fan_in_fan_out=True,
                                            target_modules=["c_attn", "c_proj", "c_fc"]))
    randomize_adapters(model)
    return model


def embedding_lora() -> torch.nn.Module:
    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    randomize_adapters(model)
    return model


def bf16_llama() -> torch.nn.Module:
    """bf16 base, fp32 adapters (PEFT's autocast_adapter_dtype)."""
    model = get_peft_model(llama(dtype=torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LINEAR))
    randomize_adapters(model)
    return model


def fp16_adapters() -> torch.nn.Module:
    """fp16 factors on the CPU: PEFT computes the delta in fp32, rounds it to fp16."""
    model = get_peft_model(llama(dtype=torch.float16),
                           LoraConfig(r=4, target_modules=[*LINEAR, "embed_tokens"]),
                           autocast_adapter_dtype=False)
    randomize_adapters(model)
    return model


@pytest.mark.parametrize("build", [two_adapters, gpt2_fan_in_fan_out, embedding_lora,
                                   bf16_llama, fp16_adapters])
def test_lora_variants_merge_as_peft_does(build):
    model = build()
    before = snapshot(model)
    wire = next(p.dtype for p in model.get_base_model().parameters())
    got, _ = push_loopback(model, wire)
    assert_same(got, oracle(model))
    assert all(torch.equal(before[k], v) for k, v in snapshot(model).items())


def test_lora_bias_merges_into_the_base_bias():
    base = llama()
    for layer in base.model.layers:  # lora_bias needs a base bias to merge into
        layer.self_attn.q_proj.bias = torch.nn.Parameter(torch.randn(64) * 0.1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    randomize_adapters(model)
    got, _ = push_loopback(model)
    want = oracle(model)
    assert_same(got, want)
    assert not torch.equal(want["model.layers.0.self_attn.q_proj.bias"],
                           base.model.layers[0].self_attn.q_proj.base_layer.bias)


def test_probe_forward_of_a_peft_model_is_the_adapted_forward():
    model = peft_llama(lora_dropout=0.5)  # dropout: the probe must run in eval mode
    model.train()
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    got, dtype = trainer_logprobs(model, ids, None)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    with torch.no_grad():
        lp = torch.log_softmax(merged(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    want = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert dtype == torch.float32 and model.training
    assert (torch.tensor(got) - want).abs().mean().item() < 1e-5


def test_plain_models_pass_through_untouched():
    model = llama()
    merge = PeftMerge(model)
    assert not merge.active and merge.base_model is model
    plan = param_plan(model)
    assert merge.plan(plan) is plan
    got, _ = push_loopback(model)
    assert_same(got, model.state_dict())


def test_merged_adapters_and_disabled_adapters_send_what_the_forward_uses():
    model = peft_llama()
    model.merge_adapter()  # W already holds the delta: sent as is, no second merge
    merged_w = snapshot(model)
    got, _ = push_loopback(model)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(got[q], merged_w[f"base_model.model.{q[:-len('weight')]}base_layer.weight"])
    model.unmerge_adapter()
    with model.disable_adapter():  # the forward runs the base model alone
        got, _ = push_loopback(model)
    base = model.get_base_model()
    assert torch.equal(got[q], base.model.layers[1].self_attn.q_proj.base_layer.weight)
    assert torch.equal(got["lm_head.weight"], base.lm_head.original_module.weight)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("build, said", [
    (lambda: get_peft_model(llama(), LoraConfig(r=4, target_modules=LINEAR, use_dora=True)),
     "model.layers.0.self_attn.q_proj"),
    (lambda: get_peft_model(llama(), IA3Config(target_modules=["q_proj"],
                                               feedforward_modules=[])),
     "base_model: peft.tuners.ia3"),
    (lambda: get_peft_model(llama(tied=True), LoraConfig(r=4, target_modules=["embed_tokens"])),
     "model.embed_tokens: its base weight is shared"),
])
def test_unsupported_peft_models_are_refused_by_module(build, said):
    with pytest.raises(PeftMergeError, match="cannot push") as e:
        PeftMerge(build())
    assert isinstance(e.value, WeightPushError) and said in str(e.value), str(e.value)
