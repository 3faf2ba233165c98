"""Run under torchrun (3 ranks, gloo): every rank packs its own rows of an
FSDP2 model with the pusher's own planner and sender, nothing gathered; rank
0 stages every rank's buckets as the server does (its manifest check, its
staging, its reassembly) and compares every tensor with torch's own full
state dict. Rank 0 writes a JSON report; tests/test_own_rows_units.py asserts.
`--replicas 2` on 4 ranks: HSDP, two replica groups of two.

The model is row_blocks_worker's (301 rows over 3 ranks: 101, 101, 99; a
2-row weight that rank 2 holds none of; a 1-D vector; a 3-D tensor) plus a
persistent int64 buffer every rank holds whole. `--shard-dim 1` shards on
another dim, which is not rows: the reason names it. Also reported: the
pieces each rank's delta diffs (shard_pieces.py), against the same state dict.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tests.rank_worker import main
from tests.row_blocks_worker import BUCKET, WIRE, build


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shard-dim", type=int, default=0)
    ap.add_argument("--bucket", type=int, default=BUCKET)
    ap.add_argument("--replicas", type=int, default=1, help="> 1: HSDP")


def _no_gather(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("a gather ran while sending own rows")


def body(args: argparse.Namespace, rank: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from rollout_sidecar.protocol.schema import BeginRequest
    from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
    from rollout_sidecar.server.weights.manifest_check import check_manifest
    from rollout_sidecar.server.weights.worker.staging import Staging
    from rollout_sidecar.trainer.collectives import all_gather_object
    from rollout_sidecar.trainer.delta.shard_pieces import shard_pieces
    from rollout_sidecar.trainer.gather.own_rows import OwnRows, rank_pieces, why_not
    from rollout_sidecar.trainer.pack.buckets import manifest
    from rollout_sidecar.trainer.pack.rank_buckets import plan_rank_buckets
    from rollout_sidecar.trainer.pack.sender import BucketSender
    from tests.test_split_buckets import LoopbackTransport  # keeps a copy of every bucket

    model = build(args.shard_dim, args.replicas)
    model.register_buffer("routes", torch.randint(0, 1 << 40, (70,)))
    world = dist.get_world_size()
    report: dict = {"why_not": why_not(model, world)}
    if report["why_not"] is not None:
        return report
    pieces = rank_pieces(model, world, ["routes"])
    buckets = plan_rank_buckets(pieces, WIRE, args.bucket)
    capture = LoopbackTransport()
    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = _no_gather  # every rank sends with nothing gathered
    try:
        checks, err = BucketSender().send_all(buckets, OwnRows(model, ["routes"]), capture,
                                              ["t"], sender=rank)
    finally:
        DTensor.full_tensor = full_tensor
    shares = all_gather_object((capture.sent, checks, err))
    # What a delta diffs on each rank (trainer/delta/shard_pieces.py): its own rows too.
    mine = shard_pieces(model, rank, ["routes"])
    diffed = all_gather_object(None if mine is None else
                               [(p.name, p.start, p.data.clone()) for p in mine])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full["routes"] = model.routes
    if rank != 0:
        return report
    report["delta_pieces"] = _pieces_against(full, diffed)
    sent, values = {}, {}
    for r, (got, share_checks, share_err) in enumerate(shares):
        assert share_err is None, (r, share_err)
        sent.update(got)
        ours = [b.index for b in buckets if b.source == r]
        values.update(zip(ours, share_checks, strict=True))
    index = CheckpointIndex({n: TensorSpec(tuple(t.shape), "bfloat16" if t.is_floating_point()
                                           else "int64") for n, t in full.items()},
                            tie_word_embeddings=False)
    req = BeginRequest(version=1, buckets=manifest(buckets))
    check_manifest(req, index, "bfloat16")  # the server's own check
    staging = Staging()
    staging.allocate(req.buckets, torch.device("cpu"))
    for k, b in enumerate(staging.buckets):  # its chunks land in place (placed_tensors.py)
        staging.stage(k, torch.frombuffer(bytearray(sent[b.index]), dtype=torch.uint8), "crc32")
    staging.check([values[b.index] for b in buckets])
    got = dict(staging.tensors())
    where: dict[str, list[int]] = {}  # each tensor's entries' places in the manifest
    for i, name in enumerate(s.name for b in buckets for s in b.params):
        where.setdefault(name, []).append(i)
    report.update(
        senders=[b.source for b in buckets],
        bytes_by_rank=[sum(len(v) for i, v in sent.items() if buckets[i].source == r)
                       for r in range(world)],
        largest_bucket=max(b.nbytes for b in buckets),
        interleaved=sorted(n for n, ix in where.items() if ix != list(range(ix[0], ix[-1] + 1))),
        compared=sorted(got),
        mismatched=[n for n, t in full.items() if not torch.equal(
            got[n], t.to(WIRE) if t.is_floating_point() else t)])
    return report


def _pieces_against(full: dict[str, torch.Tensor], by_rank: list) -> dict:
    """Every rank's delta pieces against torch's full state dict: each
    element of each tensor in exactly one piece, holding its value."""
    if any(p is None for p in by_rank):
        return {"covered": False, "why": "a rank's layout is not covered"}
    seen = {n: torch.zeros(t.numel(), dtype=torch.int64) for n, t in full.items()}
    mismatched = set()
    for pieces in by_rank:
        for name, start, data in pieces:
            seen[name][start: start + data.numel()] += 1
            if not torch.equal(full[name].reshape(-1)[start: start + data.numel()], data):
                mismatched.add(name)
    return {"covered": True,
            "not_once": sorted(n for n, c in seen.items() if not bool((c == 1).all())),
            "mismatched": sorted(mismatched),
            "elements_by_rank": [sum(d.numel() for _, _, d in p) for p in by_rank]}


if __name__ == "__main__":
    main(body, arguments)
