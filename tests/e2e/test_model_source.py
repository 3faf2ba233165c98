"""`--model` takes a hub id, resolved from the Hugging Face cache as vLLM does,
and `max_model_len` defaults to the model's own (real server, real CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_sidecar.server.model.default_model import write_default_model
from tests import processes
from tests.conftest import ServerSpec, serves, stop_server

HUB_ID = "acme/tiny-llama-256"
OWN_LEN = 256  # shorter than the old fixed default (1024), which crashed such models


def write_hub_cache(home: Path) -> Path:
    """An offline HF cache holding HUB_ID, laid out as `hf download` leaves it."""
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = write_default_model(repo / "snapshots" / sha)
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((snap / name).read_text())
        cfg[key] = OWN_LEN
        (snap / name).write_text(json.dumps(cfg))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return home


def _env(hf_home) -> dict:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    return write_hub_cache(tmp_path_factory.mktemp("hf"))


# Planned (its start overlaps the tests before it): the cache is written into
# the server's folder first.
HUB = ServerSpec("hub", model=HUB_ID, max_model_len=None,
                 prepare=lambda folder: _env(write_hub_cache(folder / "hf")))


@pytest.fixture
@serves(HUB)
def hub_server(server_plan):
    s = server_plan.take(HUB)
    yield s
    stop_server(s, wait=False)


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return processes.run([sys.executable, "-m", "rollout_sidecar.server.cli", "serve", *args],
                         env={**os.environ, **env, "COLUMNS": "200"}, timeout_s=300)


def test_a_hub_id_serves_from_the_cache_at_the_models_own_length(hub_server):
    with hub_server.client() as c:
        info = c.info()
        out = c.generate(["hello"], sampling=dict(max_tokens=4, seed=0))
    assert info.max_model_len == OWN_LEN
    assert f"models--{HUB_ID.replace('/', '--')}" in info.model
    assert len(out.results[0].samples[0].token_ids) == 4


def test_a_max_model_len_above_the_models_is_a_usage_error_naming_it(hf_home):
    r = _cli("--model", HUB_ID, "--max-model-len", "4096", env=_env(hf_home))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--max-model-len" in r.stderr and f"limit of {OWN_LEN} tokens" in r.stderr


def test_an_uncached_hub_id_offline_says_how_to_pre_download(tmp_path):
    r = _cli("--model", "acme/not-downloaded", env=_env(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "acme/not-downloaded" in r.stderr and "hf download" in r.stderr


@pytest.mark.parametrize("flag, value", [("--dtype", "fp33"), ("--commit-policy", "later"),
                                         ("--log-level", "loud"), ("--port", "0")])
def test_a_bad_enum_or_range_is_a_usage_error(flag, value, tmp_path):
    r = _cli(flag, value, env={})
    assert r.returncode == 2 and flag in r.stderr, r.stderr[-2000:]
