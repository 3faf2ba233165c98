"""LoRA adapter pushes into real vLLM-CPU (float32, --enable-lora): one
server for the module. What the trainer holds is what serves: the served
prompt logprobs equal a transformers fp32 forward of PEFT's own
`merge_and_unload()` of a copy, after the first push (adapter + base), after
adapter-only pushes (the same sequences every version: no stale prefix
cache), after a merged full push and the adapter push that follows it, and
from an FSDP2 model under torchrun. A scaling applied twice (SkyRL 2221) is
caught by the probe; bad adapter manifests are 4xx naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rollout_sidecar.trainer import WeightMismatchError, WeightPusher
from tests.conftest import ServerSpec, run_torchrun, server_fixture
from tests.e2e.adapter_push_worker import build_lora, step
from tests.e2e.peft_push_worker import gaps, scored_sequences, served
from tests.polling import engine_tokens, until_decoding

WORKER = Path(__file__).with_name("adapter_push_worker.py")
GAP_TOL = 1e-4  # mean |dlogp|, fp32 served vs fp32 transformers (the bound)


SERVER = ServerSpec.of("adapter", dtype="float32", failpoints=True,
                       env={"ROLLOUT_SIDECAR_ENABLE_LORA": "1",
                            "ROLLOUT_SIDECAR_MAX_LORA_RANK": "16",
                            "ROLLOUT_SIDECAR_LORA_KEEP": "2"})


srv = server_fixture(SERVER)


def status(srv) -> dict:
    r = httpx.get(f"{srv.url}/weights/status",
                  headers={"Authorization": f"Bearer {srv.admin_token}"})
    r.raise_for_status()
    return r.json()


def check_served(srv, model, version: int, res, encoding: str) -> dict:
    seqs = scored_sequences(srv.client().info().vocab_size)
    with srv.client() as c:
        served_version, got = served(c, version, seqs)
    r = dict(version=res.version, encoding=res.encoding, nbytes=res.nbytes,
             probe_gap=res.probe.mean_abs_dlogp if res.probe else None,
             served_version=served_version, **gaps(str(srv.model_path), model, got, seqs))
    assert r["encoding"] == encoding, (r, res.adapter_reason)
    assert r["version"] == r["served_version"] == version, r
    assert r["gap"] < GAP_TOL, r
    assert r["moved"] > 100 * GAP_TOL, r  # the adapter changed what serves
    assert res.probe is not None and res.probe.passed, r
    return r


def test_adapter_pushes_then_merged_then_adapter_serve_what_the_trainer_holds(srv, capsys):
    v = srv.client().info().weight_version
    model = build_lora(str(srv.model_path), seed=1)
    rows = []
    with WeightPusher(srv.url, admin_token=srv.admin_token, bucket_mb=1,
                      probe_tolerance=GAP_TOL) as pusher:
        res = pusher.push(model, version=v + 1)  # the server's base is not known: with it
        rows.append(check_served(srv, model, v + 1, res, "adapter+base"))
        for i in (2, 3, 4):  # adapter alone; version v+2 drops out of lora_keep=2
            step(model, seed=i)
            res = pusher.push(model, version=v + i)
            rows.append(check_served(srv, model, v + i, res, "adapter"))
        st = status(srv)["lora"]
        assert st["base_version"] == v + 1 and st["serving_adapter"], st
        assert st["adapters"] == [v + 3, v + 4], st  # lora_keep=2, nothing in flight
        step(model, seed=5)
        res = pusher.push(model, version=v + 5, adapter=False)  # merged full weights
        rows.append(check_served(srv, model, v + 5, res, "dense"))
        assert res.adapter_reason is None
        st = status(srv)["lora"]
        assert st["base_version"] == v + 5 and not st["serving_adapter"], st
        step(model, seed=6)
        res = pusher.push(model, version=v + 6)  # the base is merged weights now: with it
        rows.append(check_served(srv, model, v + 6, res, "adapter+base"))
    with capsys.disabled():
        print("\nadapter pushes (fp32):")
        for r in rows:
            print(f"  {r}")
    assert rows[1]["nbytes"] * 20 < rows[0]["nbytes"]  # the adapter is a small part


def test_scaling_applied_twice_is_caught_by_the_probe(srv):
    v = srv.client().info().weight_version
    model = build_lora(str(srv.model_path), seed=3)
    with WeightPusher(srv.url, admin_token=srv.admin_token, bucket_mb=1,
                      probe_tolerance=GAP_TOL) as pusher:
        pusher.push(model, version=v + 1)
        step(model, seed=8)
        srv.failpoints.write_text("adapter.scaling_twice")
        try:
            with pytest.raises(WeightMismatchError) as err:
                pusher.push(model, version=v + 2)
        finally:
            srv.failpoints.write_text("")
        assert status(srv)["suspect"], err.value
        step(model, seed=9)
        res = pusher.push(model, version=v + 3)  # a healthy adapter clears it
        assert res.encoding == "adapter" and res.probe.passed
        assert status(srv)["suspect"] is None


def _begin(srv, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/weights/begin", json=body,
                      headers={"Authorization": f"Bearer {srv.admin_token}"})


def test_bad_adapter_manifests_are_refused_naming_the_field(srv):
    st = status(srv)
    v, base = st["weight_version"], st["lora"]["base_version"]
    module = "model.layers.0.self_attn.q_proj"
    hidden = httpx.get(f"{srv.url}/weights/index", headers={
        "Authorization": f"Bearer {srv.admin_token}"}).json()["tensors"][
            f"{module}.weight"]["shape"][1]

    def body(r: int, adapter: dict, name: str = f"{module}.lora_A.weight") -> dict:
        return {"version": v + 1, "transport": "http", "adapter": adapter, "buckets": [
            {"index": 0, "nbytes": 4 * r * hidden, "params": [
                {"name": name, "dtype": "float32", "shape": [r, hidden], "offset": 0}]}]}

    too_big = _begin(srv, body(32, {"scaling": {module: 2.0}, "base_version": base}))
    assert too_big.status_code == 400, too_big.text
    assert "max-lora-rank" in too_big.text and "shape" in too_big.text
    stale = _begin(srv, body(8, {"scaling": {module: 2.0}, "base_version": base + 100}))
    assert stale.status_code == 409 and "base_version" in stale.text, stale.text
    one_factor = _begin(srv, body(8, {"scaling": {module: 2.0}, "base_version": base}))
    assert one_factor.status_code == 400 and "adapter.scaling" in one_factor.text
    unknown = _begin(srv, body(8, {"scaling": {"model.nope": 2.0}, "base_version": base},
                               name="model.nope.lora_A.weight"))
    assert unknown.status_code == 400 and "model.nope" in unknown.text
    assert status(srv)["weight_version"] == v and not status(srv)["push_in_progress"]


def test_fsdp2_peft_model_pushes_its_adapter(srv, tmp_path, capsys):
    v = srv.client().info().weight_version
    out = tmp_path / "report.json"
    run_torchrun(WORKER, ["--url", srv.url, "--model", str(srv.model_path), "--out", str(out)],
                 srv)
    report = json.loads(out.read_text())
    with capsys.disabled():
        print(f"\nFSDP2 adapter pushes: {report}")
    for i, (r, encoding) in enumerate(zip(report, ["adapter+base", "adapter"], strict=True)):
        assert r["error"] is None, r
        assert r["encoding"] == encoding and r["version"] == r["served_version"] == v + 1 + i
        assert r["probe_passed"] and r["gap"] < GAP_TOL, r
    assert report[1]["nbytes"] * 20 < report[0]["nbytes"]


def test_a_request_in_flight_finishes_on_its_own_adapter(srv):
    """No drain at an adapter commit: a long greedy request admitted under v
    keeps v's adapter while v+1 commits; its tokens equal those of the same
    request run on v alone, and its tag says v."""
    import threading

    v = srv.client().info().weight_version
    model = build_lora(str(srv.model_path), seed=4)
    sampling = {"max_tokens": 400, "temperature": 0.0}
    prompt = [[1, 5, 9, 14, 3, 7], [2, 8, 4], [11, 12, 13, 6], [3, 3, 3]]
    with WeightPusher(srv.url, admin_token=srv.admin_token, bucket_mb=1,
                      probe_tolerance=GAP_TOL) as pusher:
        pusher.push(model, version=v + 1)
        with srv.client() as c:
            alone = c.generate(prompt_token_ids=prompt, sampling=sampling,
                               min_weight_version=v + 1)
        step(model, seed=12)
        box: dict = {}

        def run() -> None:
            with srv.client() as c:
                box["r"] = c.generate(prompt_token_ids=prompt, sampling=sampling)
                box["done"] = pusher_done.is_set()

        pusher_done = threading.Event()
        tokens = engine_tokens(srv)
        t = threading.Thread(target=run)
        t.start()
        until_decoding(srv, tokens, "the request on v+1 decoding")
        res = pusher.push(model, version=v + 2)
        pusher_done.set()
        t.join(timeout=600)
    r = box["r"]
    assert box["done"], "the request finished before v+2 committed: it proved nothing"
    assert res.encoding == "adapter" and res.probe.passed
    assert r.weight_version == v + 1 and r.versions_used == [v + 1], r.versions_used
    got = [s.token_ids for res in r.results for s in res.samples]
    assert got == [s.token_ids for res in alone.results for s in res.samples]
