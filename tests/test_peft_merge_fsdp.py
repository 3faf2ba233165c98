"""A PEFT model under FSDP2 and FSDP1 gathers to the same merged tensors as
PEFT's own `merge_and_unload()` of an unsharded copy, leaves its shards
untouched, and its sharded forward (the probe's) is the adapted one.
torchrun, 2 ranks, gloo; no server (tests/peft_merge_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import processes, rank_pool

WORKER = Path(__file__).with_name("peft_merge_worker.py")


@pytest.mark.e2e  # torchrun ranks: not in --fast
def test_fsdp2_and_fsdp1_peft_models_push_peft_merge(tmp_path):
    out = tmp_path / "report.json"
    proc = rank_pool.run(WORKER, ["--out", str(out)], env=processes.repo_env(), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report) == {"fsdp2", "fsdp1", "fsdp1_peft_policy"}
    for wrapper, r in report.items():
        assert r["error"] is None, (wrapper, r)
        assert r["names_equal"], (wrapper, r)
        # PEFT's arithmetic on the gathered factors: bit for bit in fp32
        assert r["bitwise"] and r["max_abs_diff"] == 0.0, (wrapper, r)
        assert r["unchanged"], (wrapper, r)
        assert r["probe_gap"] < 1e-5, (wrapper, r)
    # FSDP2's row-blocked LoRA targets were joined on rank 0 before merging
    assert "(64, 64)" in report["fsdp2"]["materialized"], report["fsdp2"]
