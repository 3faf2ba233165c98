"""Run under torchrun (3 ranks, gloo): rank 0 packs an FSDP2 model's buckets
with the pusher's own sender, its large parameters drawn as row blocks, and
compares every tensor with torch's own full state dict. Rank 0 writes a JSON
report; tests/test_row_blocks.py asserts on it.

Shapes are chosen against the sharding: 301 rows over 3 ranks (101, 101, 99),
a 2-row weight (the third rank holds none), a 1-D vector, a 3-D tensor.
`--nan` puts a NaN in rank 1's rows of the embedding: the sender stops packing
there, and every rank must still finish the same collectives after it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from tests.rank_worker import main

BUCKET = 1024  # bytes: every large parameter spans many buckets and many blocks
WIRE = torch.bfloat16


def build(shard_dim: int = 0, replicas: int = 1) -> nn.Module:
    """`shard_dim`: FSDP2 shards the parameters it divides evenly on that
    dim. `replicas` > 1: HSDP, that many replica groups sharding over the
    rest of the ranks (a 2-D mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    m = nn.Module()
    m.embed = nn.Embedding(301, 24)
    m.narrow = nn.Linear(5, 2)  # weight (2, 5): rank 2 holds no rows
    m.vec = nn.Parameter(torch.randn(1000))
    m.cube = nn.Parameter(torch.randn(20, 3, 7))
    m.head = nn.Linear(24, 301)
    # (FSDP2 shards another dim only evenly: where it divides by 3.)
    mesh = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=("replicate", "shard")) if replicas > 1 else None
    fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(
        shard_dim if p.dim() > shard_dim and p.shape[shard_dim] % 3 == 0 else 0))
    return m


def reassemble(buckets: list, sent: dict[int, bytes]) -> dict[str, torch.Tensor]:
    parts: dict[str, list[tuple[int, bytes]]] = {}
    shapes = {}
    for b in buckets:
        raw = sent[b.index]
        for s in b.params:
            parts.setdefault(s.name, []).append((s.chunk_offset or 0,
                                                 raw[s.offset: s.offset + s.length]))
            shapes[s.name] = (s.shape, torch_dtype(s.dtype))
    out = {}
    for name, chunks in parts.items():
        data = b"".join(c for _, c in sorted(chunks))
        shape, dtype = shapes[name]
        out[name] = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return out


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nan", action="store_true")


def body(args: argparse.Namespace, rank: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rollout_sidecar.trainer.gather import row_blocks
    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors, param_plan
    from rollout_sidecar.trainer.pack.buckets import plan_buckets
    from rollout_sidecar.trainer.pack.sender import BucketSender
    from tests.test_split_buckets import LoopbackTransport  # keeps a copy of every bucket

    model = build()
    if args.nan:
        with torch.no_grad():
            local = model.embed.weight.to_local()
            if rank == 1:
                local[50, 3] = float("nan")
    drawn: list[int] = []  # bytes of every block rank 0 held
    next_block = row_blocks.RowBlocks.next_block

    def recorded(self):  # noqa: ANN001, ANN202
        block = next_block(self)
        if block is not None:
            drawn.append(block.numel() * block.element_size())
        return block

    row_blocks.RowBlocks.next_block = recorded
    kinds = {n: type(t).__name__ for n, t in iter_full_tensors(model, None, (), BUCKET)}
    report: dict = {"kinds": kinds}
    if rank == 0:
        buckets = plan_buckets(param_plan(model), WIRE, BUCKET)
        capture = LoopbackTransport()
        gathers = iter_full_tensors(model, None, (), BUCKET)
        _, err = BucketSender().send_all(buckets, gathers, capture, ["t"])
        for _ in gathers:  # as the pusher does: finish every gather the peers are in
            pass
        report.update(error=err, buckets=len(buckets), largest_block=max(drawn))
    else:
        for _ in iter_full_tensors(model, None, (), BUCKET):
            pass
    # torch's own full state dict: the oracle, and a collective every rank must
    # reach in step after the blocks (a rank left behind would hang here).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        if err is None:
            got = reassemble(buckets, capture.sent)
            report["mismatched"] = [n for n, t in full.items() if not torch.equal(
                got[n].view(torch.int16), t.to(WIRE).view(torch.int16))]
            report["compared"] = sorted(got)
    return report


if __name__ == "__main__":
    main(body, arguments)
