"""A PEFT (LoRA) model pushes as merged weights: one real float32 server
(the default model), a LoRA copy of it on every linear plus a trained
lm_head, pushed plain (in this process) and under FSDP2 and FSDP1 (torchrun,
2 ranks, gloo). The served prompt logprobs must equal a transformers fp32
forward of PEFT's own `merge_and_unload()` of a copy, the version advance,
and the probe (the trainer's adapted forward vs the server) pass."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rollout_sidecar.trainer import WeightPusher
from tests.conftest import run_torchrun
from tests.e2e.peft_push_worker import build_peft, gaps, scored_sequences, served

WORKER = Path(__file__).with_name("peft_push_worker.py")
GAP_TOL = 1e-5  # mean |dlogp|, fp32 served vs fp32 transformers (the bound)


@pytest.fixture(scope="module")
def srv(fp32_server):
    return fp32_server  # shared with the other float32 modules (tests/conftest.py)


def assert_merged_served(r: dict, version: int) -> None:
    assert r["error"] is None, r
    assert r["version"] == r["served_version"] == version, r
    assert r["probe_passed"], r
    assert r["gap"] < GAP_TOL, r
    assert r["moved"] > 1000 * GAP_TOL, r  # the merged weights are not the checkpoint's


def test_plain_peft_model_serves_its_merged_weights(srv, capsys):
    with srv.client() as c:
        info = c.info()
    v = info.weight_version + 1
    model = build_peft(str(srv.model_path), seed=1)
    before = copy.deepcopy(model.state_dict())
    pusher = WeightPusher(srv.url, admin_token=srv.admin_token, bucket_mb=1,
                          probe_tolerance=1e-4)
    try:
        res = pusher.push(model, version=v)
    finally:
        pusher.close()
    assert all(t.equal(before[k]) for k, t in model.state_dict().items())  # untouched
    seqs = scored_sequences(info.vocab_size)
    with srv.client() as c:
        served_version, got = served(c, v, seqs)
    r = dict(error=None, version=res.version, served_version=served_version,
             probe_passed=res.probe.passed, probe_gap=res.probe.mean_abs_dlogp,
             nbytes=res.nbytes, push_s=res.timings["total_s"],
             **gaps(str(srv.model_path), model, got, seqs))
    with capsys.disabled():
        print(f"\nplain PEFT push: {r}")
    assert_merged_served(r, v)


def test_fsdp2_and_fsdp1_peft_models_serve_their_merged_weights(srv, tmp_path, capsys):
    with srv.client() as c:
        v = c.info().weight_version
    out = tmp_path / "report.json"
    run_torchrun(WORKER, ["--url", srv.url, "--model", str(srv.model_path), "--out", str(out),
                          "--wrappers", "fsdp2,fsdp1"], srv)
    report = json.loads(out.read_text())
    with capsys.disabled():
        print(f"\nsharded PEFT pushes: {report}")
    assert_merged_served(report["fsdp2"], v + 1)
    assert_merged_served(report["fsdp1"], v + 2)
