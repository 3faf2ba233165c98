"""Delta pushes without a server: each rank diffs its own shard, rank 0 packs
the patches with the pusher's sender, the server's own code applies them into
the staged copy of the previous push, and every tensor then equals torch's
own full state dict, cast to bf16, bit for bit (tests/delta_worker.py).
torchrun, 2 ranks (HSDP: 4, two replica groups of two), gloo, a tiny Llama;
the resident copy is split across small buckets, so patches also land in
chunks of split tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import processes, rank_pool

WORKER = Path(__file__).with_name("delta_worker.py")


def run(tmp_path: Path, wrap: str, *flags: str) -> dict:
    out = tmp_path / "report.json"
    proc = rank_pool.run(WORKER, ["--out", str(out), "--wrap", wrap, *flags],
                         nproc=4 if wrap == "hsdp" else 2, env=processes.repo_env(),
                         timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.e2e  # torchrun ranks: not in --fast
@pytest.mark.parametrize("wrap", ["plain", "fsdp2", "hsdp", "fsdp1"])
def test_a_delta_restores_torchs_full_state_dict_bit_for_bit(tmp_path, wrap):
    r = run(tmp_path, wrap)
    assert r["split"] > 0  # some resident tensors are split across buckets
    copies = r["copy_bytes_by_rank"]
    if wrap == "plain":  # rank 0 alone diffs: the others keep nothing
        assert copies[0] > 0 and copies[1] == 0
    else:  # one shard copy per rank: about 1/N of the bf16 model each (with
        # HSDP every replica group diffs its part of each shard: nothing twice)
        assert all(0 < c < 1.2 / len(copies) * sum(copies) for c in copies), copies
    assert [p["version"] for p in r["pushes"]] == [2, 3]
    for p in r["pushes"]:
        assert p["error"] is None and p["crc"], p
        assert p["mismatched"] == [], p  # every tensor equals the oracle's bits
        # The step changed some elements, not all; exactly those travelled.
        assert 0 < p["changed"] == p["elements"] - p["unchanged_before"], p
        assert p["written"] == p["changed"]
        assert p["delta_bytes"] < 0.2 * p["dense_bytes"], p


@pytest.mark.e2e  # torchrun ranks: not in --fast
def test_a_nan_in_another_ranks_shard_is_refused(tmp_path):
    r = run(tmp_path, "fsdp2", "--nan")
    first, second = r["pushes"]
    assert first["error"] is None
    kind, message = second["error"]
    assert kind == "nonfinite" and "model.layers.1.mlp.up_proj.weight" in message


@pytest.mark.parametrize("source", ["fp32", "bf16", "bf16-unaligned"])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.05, 0.6])
def test_the_chunked_diff_finds_what_a_whole_tensor_compare_finds(monkeypatch, density,
                                                                   source):
    """ShardCopy's host diff runs in chunks: changes across chunk borders, in
    chunks with none, and a piece turning dense midway give what one
    whole-tensor compare gives (a piece that starts mid-tensor included).
    fp32 master weights are cast per chunk; a piece already in the wire dtype
    is compared in place, 8 bytes at a time where aligned (`bf16`), element
    by element where not (`bf16-unaligned`)."""
    import torch

    from rollout_sidecar.protocol.data_plane.delta_codec import bits
    from rollout_sidecar.trainer.delta import shard_copy
    from rollout_sidecar.trainer.delta.shard_pieces import Piece

    monkeypatch.setattr(shard_copy, "CHUNK", 64)
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if source == "fp32" else torch.bfloat16
    master = torch.randn(1001, generator=g).to(dtype)
    # A view from element 1: its first byte is not 8-byte aligned.
    master = master[1:] if source == "bf16-unaligned" else master[:1000]
    master[5] = 0.0
    piece = Piece("w", 300, master)
    copy = shard_copy.ShardCopy()
    copy.refresh([piece], [torch.bfloat16], 1)
    hit = torch.rand(1000, generator=g) < density
    hit[[63, 64, 999]] = density > 0  # around a chunk border, and the last element
    master[hit] += 0.5
    if density:
        master[5] = -0.0  # equal in value, another bit pattern: a change
    for dense_above in (0.25, 1.0):
        got = copy.diff(0, piece, dense_above)
        want = shard_copy._diff_whole(piece, copy._tensors[0], dense_above)
        assert (got.count, got.first, got.last, got.max_gap) == \
            (want.count, want.first, want.last, want.max_gap)
        assert (got.where is None) == (want.where is None)
        if want.where is not None:
            assert torch.equal(got.where, want.where)
            assert torch.equal(bits(got.values), bits(want.values))
    assert (got.count > 0) == (density > 0)
