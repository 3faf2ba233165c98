"""The trainer's side of a push from CUDA: FSDP2 with CPUOffloadPolicy (which
needs an accelerator, so CI cannot run it), non-finite refusal on the device,
and the probe's forward with offloaded parameters. Marked gpu.

The device machine has no vLLM, so the server is a stand-in that captures the
bytes a real server would receive (`CapturingServer`, a fake, as this says).
The oracle is torch's own full state dict, written out by transformers'
`save_pretrained`: the checkpoint layout the server expects.
"""

from __future__ import annotations

import zlib

import pytest
import torch

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


class CapturingServer:
    """Fake admin client: answers the control plane, keeps the bucket bytes."""

    def __init__(self, checkpoint: dict[str, torch.Tensor], vocab: int) -> None:
        from rollout_sidecar.client.protocol import TensorInfo, WeightIndex, WeightStatus

        self.status_ = WeightStatus(weight_version=0, dtype="bfloat16", vocab_size=vocab,
                                    max_model_len=512, boot_id="gpu-test", push_state="idle",
                                    push_in_progress=False, connected=None, data_plane_port=0,
                                    transports=["http"], push_timeout_s=60, commit_drain_s=1)
        self.index_ = WeightIndex(tensors={n: TensorInfo(shape=list(t.shape), dtype="bfloat16")
                                           for n, t in checkpoint.items()},
                                  ignored=[], tie_word_embeddings=False)
        self.base_url = "http://capturing"
        self.buckets: dict[int, bytes] = {}
        self.manifest: list[dict] = []
        self.aborted: str | None = None

    def status(self):  # noqa: ANN201
        return self.status_

    def index(self):  # noqa: ANN201
        return self.index_

    def begin(self, version, transport, buckets, connection_id, commit_policy,  # noqa: ANN001, ANN201
              budget_s=300.0):
        from rollout_sidecar.client.protocol import BeginResponse

        self.manifest = buckets
        return BeginResponse(push_id="p", deadline_s=60, commit_policy="wait")

    def put_bucket(self, push_id, index, data, checksum, budget_s=300.0) -> None:  # noqa: ANN001
        assert zlib.crc32(data) == checksum
        self.buckets[index] = data

    def prepare(self, push_id, checksums, timeout_s):  # noqa: ANN001, ANN201
        from rollout_sidecar.client.protocol import PrepareResponse

        assert [zlib.crc32(self.buckets[i]) for i in range(len(checksums))] == checksums
        return PrepareResponse(push_id=push_id, deadline_s=60, timings={})

    def commit(self, push_id, checksums, timeout_s):  # noqa: ANN001, ANN201
        from rollout_sidecar.client.protocol import CommitResponse

        return CommitResponse(weight_version=1, push_id=push_id, commit_policy="wait",
                              timings={})

    def abort(self, push_id, reason) -> None:  # noqa: ANN001
        self.aborted = reason

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for b in self.manifest:
            raw = torch.frombuffer(bytearray(self.buckets[b["index"]]), dtype=torch.uint8)
            for p in b["params"]:
                dt = getattr(torch, p["dtype"])
                n = torch.Size(p["shape"]).numel() * dt.itemsize
                out[p["name"]] = raw[p["offset"]: p["offset"] + n].view(dt).view(p["shape"])
        return out


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
