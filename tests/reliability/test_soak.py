"""Honest version tags under load: 32 clients during 20 pushes, per policy
(wait, the default, in test_restart_soak.py).

Every response's tokens must reproduce, in an fp32 transformers forward, the
weights of a version the response lists (and only one under wait and abort).
Zero non-2xx answers.
"""

from __future__ import annotations

import json

import pytest

from tests.reliability.conftest import served_version
from tests.reliability.oracle import classify
from tests.reliability.soak import run_soak

pytestmark = pytest.mark.slow
PUSHES, CLIENTS = 20, 32


# The default policy, wait, is soaked in test_restart_soak.py (60 pushes, a
# replica killed and restarted 3 times).
@pytest.mark.parametrize("policy", ["abort", "keep"])
def test_under_load_every_response_names_the_weights_that_made_it(reliable, trainer, oracle,
                                                                 policy):
    start = served_version(reliable)
    res = run_soak(reliable, trainer.pusher, trainer.weights, policy, start + 1,
                   pushes=PUSHES, clients=CLIENTS)
    verdicts = classify(res.samples, oracle, range(start, start + PUSHES + 1),
                        keep=policy == "keep")
    row = dict(policy=policy, requests=res.requests, non_2xx=len(res.failures),
               samples=len(res.samples), **dict(verdicts.counts),
               multi_version_responses=len({s.response for s in res.samples
                                            if len(s.claimed) > 1}),
               p50_s=round(res.quantile(0.5), 3), p99_s=round(res.quantile(0.99), 3),
               max_gate_hold_s=round(max(res.gate_holds, default=0), 3),
               commit_modes=sorted(set(res.commit_modes)))
    print("SOAK " + json.dumps(row))
    assert not res.push_errors, res.push_errors
    assert res.versions == list(range(start + 1, start + PUSHES + 1))
    assert res.failures == [], res.failures[:5]
    overlisted = verdicts.counts.pop("overlisted_responses", 0)
    assert res.samples and verdicts.counts["honest"] == sum(verdicts.counts.values()), \
        (dict(verdicts.counts), verdicts.examples)
    assert overlisted == 0  # under keep: no version listed that came after it finished
    if policy != "keep":  # one version per response, the one all its tokens came from
        assert all(len(s.claimed) == 1 for s in res.samples)
    else:  # requests did run across swaps, and said so
        assert any(len(s.claimed) > 1 for s in res.samples)
