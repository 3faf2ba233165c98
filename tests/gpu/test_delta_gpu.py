"""Delta pushes on CUDA (marked gpu): each rank's diff runs on the shard's own
device (`delta_copy="device"`) with NCCL collectives, and the patches restore
torch's own full state dict, cast to bf16, bit for bit. One process (world 1)
on the device machine; the 2-rank layouts run on CPU in
tests/test_delta_push_units.py, the same code with gloo.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_cuda_fsdp2_delta_restores_the_full_state_dict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_sidecar.protocol.data_plane.delta_codec import apply, bits
    from rollout_sidecar.trainer.delta.delta_push import DeltaPush
    from rollout_sidecar.trainer.push_opening import Opening
    from tests.gpu.test_push_gpu import _group

    _group()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).cuda()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    def full() -> dict[str, torch.Tensor]:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.to(torch.bfloat16).cpu() for k, v in sd.items()}

    before = full()
    opening = Opening(False, "bfloat16", {}, [], None, None)
    delta = DeltaPush("device", dense_above=0.25)
    delta.committed(model, opening, 1)
    assert all(t.is_cuda for t in delta.copy._tensors)
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    plan, why = delta.plan(model, Opening(False, "bfloat16", {}, [], 1, None), 1 << 20)
    assert plan is not None, why
    got = {n: t.clone() for n, t in before.items()}
    for name, patch in plan.diff.patches(plan.buckets, plan.plans):
        assert not isinstance(patch, Exception), patch
        apply(patch.__class__(patch.form, patch.numel, patch.positions.cpu(),
                              patch.values.cpu()), got[name])
    after = full()
    assert all(torch.equal(bits(got[n]), bits(after[n])) for n in after)
    changed = sum(p.changed for p in plan.plans)
    assert 0 < changed < 0.2 * sum(t.numel() for t in after.values())
