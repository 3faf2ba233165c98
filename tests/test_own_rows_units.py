"""Every trainer rank sends its own FSDP2 rows, nothing gathered
(trainer/gather/own_rows.py): the planner's layout, and a real 3-rank gloo
FSDP2 model whose buckets, staged and reassembled by the server's own code,
equal torch's full state dict bit for bit (tests/own_rows_worker.py); a
delta's pieces (trainer/delta/shard_pieces.py) are the same rows, HSDP's too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout_sidecar.protocol.schema import BeginRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.trainer.gather.own_rows import Piece
from rollout_sidecar.trainer.pack.buckets import manifest
from rollout_sidecar.trainer.pack.rank_buckets import plan_rank_buckets
from tests import processes, rank_pool

WORKER = Path(__file__).with_name("own_rows_worker.py")


def _pieces(world: int) -> list[list[Piece]]:
    """A (301, 24) tensor's rows over `world` ranks (torch.chunk's split), a
    small one held whole by rank 0."""
    out: list[list[Piece]] = [[] for _ in range(world)]
    c = -(-301 // world)
    for r in range(world):
        if r * c < 301:
            out[r].append(Piece("w", (301, 24), torch.float32, r * c, min(301, (r + 1) * c)))
    out[0].append(Piece("b", (24,), torch.float32, 0, 24))
    return out


@pytest.mark.parametrize("world, bucket", [(2, 1024), (3, 4096), (4, 64), (3, 1 << 20)])
def test_each_rank_buckets_hold_its_rows_once_and_the_manifest_alternates(world, bucket):
    buckets = plan_rank_buckets(_pieces(world), torch.bfloat16, bucket)
    index = CheckpointIndex({"w": TensorSpec((301, 24), "bfloat16"),
                             "b": TensorSpec((24,), "bfloat16")}, tie_word_embeddings=False)
    check_manifest(BeginRequest(version=1, buckets=manifest(buckets)), index, "bfloat16")
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert all(b.nbytes <= bucket for b in buckets)
    c = -(-301 // world)
    for b in buckets:  # each chunk of w lies inside its sender's rows
        for s in b.params:
            if s.name == "w":
                first, end = b.source * c * 48, min(301, (b.source + 1) * c) * 48
                assert first <= s.chunk_offset and s.chunk_offset + s.length <= end, (b, s)
    # The first `world` buckets come from `world` different ranks (taken side by side).
    assert len({b.source for b in buckets[:world]}) == min(world, len(buckets))


def run(tmp_path: Path, *flags: str, nproc: int = 3) -> dict:
    out = tmp_path / "report.json"
    proc = rank_pool.run(WORKER, ["--out", out, *flags], nproc=nproc, env=processes.repo_env(),
                         timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.e2e  # torchrun ranks: not in --fast
@pytest.mark.parametrize("bucket", ["1024", "100000"])
def test_own_rows_staged_by_the_server_equal_torch_full_state_dict(tmp_path, bucket):
    r = run(tmp_path, "--bucket", bucket)
    assert r["why_not"] is None
    assert r["mismatched"] == []
    assert r["compared"] == sorted(["embed.weight", "narrow.weight", "narrow.bias", "vec",
                                    "cube", "head.weight", "head.bias", "routes"])
    assert r["largest_bucket"] <= int(bucket)
    # Every rank sent: each about a third of the bytes (rank 2 holds 99 of 301
    # rows, and none of the 2-row weight), and the sharded tensors' chunks lie
    # in buckets of different ranks, not one after the other.
    assert set(r["senders"]) == {0, 1, 2}
    _delta_pieces_are_own_rows(r, 3)
    total = sum(r["bytes_by_rank"])
    assert all(0.25 * total < b < 0.42 * total for b in r["bytes_by_rank"]), r["bytes_by_rank"]
    if bucket == "1024":  # several buckets a rank
        assert {"embed.weight", "head.weight", "vec"} <= set(r["interleaved"]), r["interleaved"]


@pytest.mark.e2e
def test_a_shard_on_another_dim_is_not_rows_and_names_the_parameter(tmp_path):
    r = run(tmp_path, "--shard-dim", "1")
    assert r["why_not"].startswith("cube is not a row shard: placements [Shard(dim=1)]"), r


@pytest.mark.e2e
def test_hsdp_replica_groups_each_send_a_part_of_their_rows(tmp_path):
    """HSDP, 2 replica groups x 2 shards: each group holds the whole model,
    so each sends half of every shard's rows; every rank's link carries
    about a quarter, and nothing is gathered."""
    r = run(tmp_path, "--replicas", "2", "--bucket", "1024", nproc=4)
    assert r["why_not"] is None, r
    assert r["mismatched"] == [] and "embed.weight" in r["compared"]
    assert set(r["senders"]) == {0, 1, 2, 3}
    total = sum(r["bytes_by_rank"])
    assert all(0.15 * total < b < 0.35 * total for b in r["bytes_by_rank"]), r["bytes_by_rank"]
    # A delta diffs the same parts: every element once across both replica groups.
    _delta_pieces_are_own_rows(r, 4)


def _delta_pieces_are_own_rows(r: dict, world: int) -> None:
    """Each rank's delta pieces (shard_pieces.py) hold every element of every
    tensor exactly once, with torch's values, spread over the ranks."""
    d = r["delta_pieces"]
    assert d["covered"], d
    assert d["not_once"] == [] and d["mismatched"] == [], d
    total = sum(d["elements_by_rank"])
    assert all(0.6 / world * total < n < 1.4 / world * total
               for n in d["elements_by_rank"]), d["elements_by_rank"]
