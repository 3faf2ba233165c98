"""Offload-aware gathers on CUDA (FSDP2 CPUOffloadPolicy, FSDP1 CPUOffload,
params moved to the CPU by hand). Marked gpu: skipped without CUDA and on CI;
run on the device machine with 2 ranks sharing one GPU (gloo for the FSDP
group is not enough for offload, so this uses NCCL when 2 GPUs exist, else a
single rank)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _single_rank_group():
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from tests.conftest import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


@pytest.mark.parametrize("block_bytes", [None, 1024], ids=["full_tensor", "row_blocks"])
def test_fsdp2_cpu_offload_gathers_full_tensors_and_leaves_nothing_on_gpu(block_bytes):
    """Row blocks (parameters over a quarter block): the offloaded rows go to
    the GPU a block at a time, into one buffer freed with the walk."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors
    from rollout_sidecar.trainer.gather.row_blocks import RowBlocks

    _single_rank_group()
    ref = {k: v.clone() for k, v in _model().state_dict().items()}
    m = _model().cuda()
    for layer in (m[0], m[2]):
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(m, offload_policy=CPUOffloadPolicy())

    def gather() -> tuple[dict, dict]:
        got, kinds = {}, {}
        for n, t in iter_full_tensors(m, torch.device("cuda"), (), block_bytes):
            kinds[n] = type(t).__name__
            got[n] = (t.materialize() if isinstance(t, RowBlocks) else t).cpu()
        torch.cuda.synchronize()
        return got, kinds

    # FSDP2's lazy init on the first unshard keeps 512 bytes on the GPU for the
    # module's life (seen on an H100); what a user pays per push is the growth
    # after that, which must be none.
    first = torch.cuda.memory_allocated()
    gather()
    before = torch.cuda.memory_allocated()
    assert before - first <= 4096, before - first
    got, kinds = gather()
    # 0.weight: 16 KiB of fp32 rows, 1 KiB blocks
    assert kinds["0.weight"] == ("RowBlocks" if block_bytes else "Tensor")
    assert torch.cuda.memory_allocated() <= before  # nothing new stays on the GPU
    assert all(p.to_local().device.type == "cpu" for p in m.parameters())  # still offloaded
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v)


def test_params_moved_to_cpu_by_hand_are_gathered():
    from torch.distributed.fsdp import fully_shard

    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors

    _single_rank_group()
    ref = {k: v.clone() for k, v in _model().state_dict().items()}
    m = _model().cuda()
    fully_shard(m)
    m.to("cpu")  # e.g. offloaded between steps to make room for the rollout engine
    got = {n: t.cpu() for n, t in iter_full_tensors(m, torch.device("cuda"))}
    assert all(p.to_local().device.type == "cpu" for p in m.parameters())
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v)


def test_fsdp1_cpu_offload_gathers_full_tensors():
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors

    _single_rank_group()
    ref = {k: v.clone() for k, v in _model().state_dict().items()}
    m = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True), device_id=0,
             use_orig_params=True)
    got = {n: t.cpu().clone() for n, t in iter_full_tensors(m)}
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v)
