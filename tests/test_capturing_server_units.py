"""Keeps the `gpu` tests' fake admin client (`tests/gpu/capturing_server.py`)
in step with the real one on CPU: the `gpu` tests run only in sessions lent a
GPU, and between them the fake fell behind `WeightAdminClient.begin` once. A unit
test with a fake server, as it says; the real server's pushes are the e2e
tests'."""

from __future__ import annotations

import inspect

import pytest
import torch

from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from tests.gpu.capturing_server import CapturingServer


@pytest.mark.parametrize("method", ["status", "index", "begin", "put_bucket", "prepare",
                                    "commit", "abort", "close"])
def test_the_fake_takes_what_the_admin_client_takes(method):
    real = inspect.signature(getattr(WeightAdminClient, method)).parameters
    fake = inspect.signature(getattr(CapturingServer, method)).parameters
    assert [(p.name, p.default) for p in fake.values()] == \
        [(p.name, p.default) for p in real.values()]


def test_a_push_through_the_fake_carries_torch_state_dict_bit_for_bit(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_sidecar.trainer import WeightPusher
    from rollout_sidecar.trainer.transport.http_upload import HttpUploadTransport

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    ckpt = load_file(tmp_path / "ckpt" / "model.safetensors")
    model.float()
    server = CapturingServer(ckpt, cfg.vocab_size)
    with WeightPusher("http://unused", transport="http", probe=False, bucket_mb=0.05) as pusher:
        pusher.replicas.admins = [server]
        pusher.replicas.refresh = lambda: False
        pusher.transport = HttpUploadTransport(pusher.replicas)
        assert pusher.push(model, version=1).version == 1
    assert server.aborted is None and len(server.buckets) > 1
    pushed = server.tensors()
    assert set(pushed) == set(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(pushed[name], t), name
