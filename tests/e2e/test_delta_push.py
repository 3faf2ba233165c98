"""Delta pushes into real vLLM servers (bf16, the default model).

- Two servers get the same FSDP2-trained weights, A by delta (the default)
  and B dense: every answer must be bit-identical (tests/e2e/delta_pair_worker.py).
- The base: a replica that restarted, or that another trainer pushed to
  (takeover), gets a dense push; a failed push (NaN) keeps the base, so the
  next one is a delta against it. The trainer here is this test's process (a
  plain module, rank 0 alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ServerSpec, run_torchrun, serves, start_server, stop_server

WORKER = Path(__file__).with_name("delta_pair_worker.py")
pytestmark = pytest.mark.slow


DELTA_A, DELTA_B = ServerSpec("delta-a"), ServerSpec("delta-b")


@pytest.fixture(scope="module")
@serves(DELTA_A, DELTA_B)
def pair(server_plan):
    a, b = server_plan.take(DELTA_A), server_plan.take(DELTA_B)
    yield a, b
    stop_server(a, wait=False)
    stop_server(b, wait=False)


def test_delta_and_dense_replicas_serve_bit_identical_answers(pair, tmp_path):
    a, b = pair
    out = tmp_path / "pair.json"
    run_torchrun(WORKER, ["--delta-url", a.url, "--dense-url", b.url, "--dense-tokens",
                          f"{b.admin_token},{b.api_token}", "--model", str(a.model_path),
                          "--out", str(out)], a)
    pushes = json.loads(out.read_text())["pushes"]
    for p in pushes:
        print("DELTA-PAIR", json.dumps(p))
    first, *later = pushes
    assert first["encoding"] == ["dense", "dense"]  # nothing to diff against yet
    assert "first push" in first["why_dense"]
    for p in later:
        assert p["encoding"] == ["delta", "dense"], p
        assert p["delta_base"] == p["version"] - 1
        assert p["versions"] == [p["version"]] * 2
        # The step changed some elements, not all, and only those travelled.
        assert 0 < p["changed"] < 0.2 * p["elements"], p
        assert p["nbytes"][0] < 0.25 * p["nbytes"][1], p
    for p in pushes:  # the same weights: the same answers, to the bit
        assert p["same_samples"] and p["same_scored"], p
        assert p["probe"][0] == p["probe"][1]


def test_restart_takeover_and_failed_push_decide_the_base(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import NonFiniteWeightsError, WeightPusher

    a, _ = pair
    model = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(4)

    def step() -> None:
        batch = torch.randint(0, 256, (2, 24), generator=g)
        opt.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()

    def served() -> int:
        with a.client() as c:
            return c.info().weight_version

    pusher = WeightPusher(a.url, a.admin_token, bucket_mb=1)
    v = served()
    results = []

    def push(p: WeightPusher = pusher):
        nonlocal v
        step()
        v += 1
        results.append(p.push(model, version=v))
        return results[-1]

    try:
        push()
        assert push().encoding == "delta"
        # Nothing changed: no bucket moves and nothing loads; the replica
        # serves what it holds as the new version (the probe checks it), and
        # the next delta builds on that.
        v += 1
        results.append(pusher.push(model, version=v))
        r = results[-1]
        assert (r.encoding, r.delta_base, r.buckets, r.nbytes) == ("delta", v - 1, 0, 0), r
        assert served() == v and r.changed == 0, r
        assert "server_load_s" not in r.timings and "server_pause_s" not in r.timings, r
        r = push()
        assert (r.encoding, r.delta_base) == ("delta", v - 1) and r.changed > 0, r
        # A failed push (a NaN, refused on the trainer) leaves the base as it was.
        step()
        w = model.model.layers[0].mlp.up_proj.weight
        kept = w.data[0, 0].item()
        w.data[0, 0] = float("nan")
        with pytest.raises(NonFiniteWeightsError):
            pusher.push(model, version=v + 1)
        w.data[0, 0] = kept
        assert served() == v
        r = push()
        assert (r.encoding, r.delta_base) == ("delta", v - 1), r
        # A restarted replica holds no base: dense, then deltas again.
        stop_server(a)
        restarted = start_server(tmp_path, "delta-a2", like=a)
        a.proc = restarted.proc
        r = push()
        assert r.encoding == "dense" and r.server_restarted, r
        assert "holds nothing it can patch" in r.delta_reason
        assert push().encoding == "delta"
        # Another trainer took the replica over: its push is dense (it has no
        # copy), and so is ours after it (the replica holds its version).
        other = WeightPusher(a.url, a.admin_token, bucket_mb=1, takeover=True)
        try:
            assert push(other).encoding == "dense"
        finally:
            other.close()
        r = push()
        assert r.encoding == "dense" and f"holds version {v - 1}" in r.delta_reason, r
        assert push().encoding == "delta"
    finally:
        pusher.close()
    for r in results:
        print("DELTA-BASE", r.version, r.encoding, r.delta_base, r.nbytes, r.delta_reason)
        assert r.probe is not None and r.probe.passed, r
