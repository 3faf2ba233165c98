"""The trainer's side of a push from CUDA: FSDP2 with CPUOffloadPolicy (which
needs an accelerator, so CI cannot run it), non-finite refusal on the device,
and the probe's forward with offloaded parameters. Marked gpu.

The device machine has no vLLM, so the server is a stand-in that captures the
bytes a real server would receive (`CapturingServer`, a fake, as this says).
The oracle is torch's own full state dict, written out by transformers'
`save_pretrained`: the checkpoint layout the server expects.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.capturing_server import CapturingServer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _group() -> None:
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from tests.conftest import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)


def _model(family: str, tmp_path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    from tests.fidelity.zoo import write_family

    path = write_family(family, tmp_path / family)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda(), path


def _offloaded_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return model


def _pusher(server: CapturingServer):  # noqa: ANN202
    from rollout_sidecar.trainer import WeightPusher
    from rollout_sidecar.trainer.transport.http_upload import HttpUploadTransport

    pusher = WeightPusher("http://unused", transport="http", probe=False, bucket_mb=0.25)
    pusher.replicas.admins = [server]
    pusher.replicas.refresh = lambda: False
    pusher.transport = HttpUploadTransport(pusher.replicas)
    return pusher


def _checkpoint_of(model_path, state: dict[str, torch.Tensor], tmp_path) -> dict:
    """torch's full state dict, saved by transformers: the server's layout."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref.load_state_dict(state, strict=False)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "oracle")
    ckpt = load_file(tmp_path / "oracle" / "model.safetensors")
    if ref.config.tie_word_embeddings:
        ckpt.pop("lm_head.weight", None)
    return ckpt


@pytest.mark.parametrize("family", ["llama-tied-gqa", "qwen3-moe"])
def test_offloaded_fsdp2_push_carries_torch_full_state_dict(family, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _group()
    model, path = _model(family, tmp_path)
    model = _offloaded_fsdp2(model)
    batch = torch.randint(0, 264, (2, 16), device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
    ckpt = _checkpoint_of(path, state, tmp_path)
    server = CapturingServer(ckpt, 264)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    res = _pusher(server).push(model, version=1)
    torch.cuda.synchronize()
    assert res.version == 1 and server.aborted is None
    assert torch.cuda.memory_allocated() <= before  # the gather left nothing on the GPU
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())  # still offloaded
    pushed = server.tensors()
    assert set(pushed) == set(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(pushed[name], t), name  # bit for bit, in checkpoint layout


def test_nan_on_the_device_is_refused_by_name(tmp_path):
    from torch.distributed.fsdp import fully_shard

    from rollout_sidecar.trainer import NonFiniteWeightsError

    _group()
    model, path = _model("llama-tied-gqa", tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 3] = float("inf")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    server = CapturingServer(_checkpoint_of(path, {}, tmp_path), 264)
    with pytest.raises(NonFiniteWeightsError, match="model.layers.1.mlp.up_proj.weight"):
        _pusher(server).push(model, version=1)
    assert "NaN or inf" in server.aborted


def test_probe_forward_runs_on_the_gpu_with_offloaded_params(tmp_path):
    from rollout_sidecar.trainer.probe import probe_token_ids, trainer_logprobs

    _group()
    model, _ = _model("llama-untied-mha", tmp_path)
    ids = probe_token_ids(264, 512)
    expected, _ = trainer_logprobs(model, ids, None)  # plain CUDA model
    got, dtype = trainer_logprobs(_offloaded_fsdp2(model), ids, None)
    assert dtype == torch.float32
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
