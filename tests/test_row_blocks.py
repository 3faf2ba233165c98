"""FSDP2 parameters larger than a bucket reach rank 0 as row blocks: the
bytes packed equal torch's own full state dict, rank 0 never holds more than
a bucket of a gather, and a pack that stops early leaves no rank behind.
torchrun, 3 ranks, gloo; no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import processes, rank_pool

WORKER = Path(__file__).with_name("row_blocks_worker.py")
BUCKET = 1024


def run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "report.json"
    proc = rank_pool.run(WORKER, ["--out", out, *flags], nproc=3, env=processes.repo_env(),
                         timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.e2e  # torchrun ranks: not in --fast
def test_row_blocks_equal_torch_full_state_dict(tmp_path):
    r = run(tmp_path)
    assert r["error"] is None
    # every parameter over a bucket came as row blocks; the small ones whole
    assert r["kinds"] == {"vec": "RowBlocks", "cube": "RowBlocks", "embed.weight": "RowBlocks",
                          "narrow.weight": "Tensor", "narrow.bias": "Tensor",
                          "head.weight": "RowBlocks", "head.bias": "RowBlocks"}, r["kinds"]
    assert r["compared"] == sorted(["embed.weight", "narrow.weight", "narrow.bias", "vec",
                                    "cube", "head.weight", "head.bias"])
    assert r["mismatched"] == []
    assert 0 < r["largest_block"] <= BUCKET


@pytest.mark.e2e  # torchrun ranks: not in --fast
def test_a_pack_that_stops_early_leaves_no_rank_behind(tmp_path):
    r = run(tmp_path, "--nan")
    assert r["error"][0] == "nonfinite" and "embed.weight" in r["error"][1]
