"""Shared fixtures: one real vLLM CPU server per test session (started by
rollout_sidecar.server.launcher, the one launcher the demo and benches use too)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_sidecar.server.launcher import free_port, launch_server, stop_process
from tests import processes

REPO = Path(__file__).resolve().parents[1]
__all__ = ["REPO", "Server", "free_port", "run_torchrun", "start_server", "stop_server"]


@dataclass
class Server:
    url: str
    api_token: str
    admin_token: str
    model_path: Path
    proc: subprocess.Popen
    log: Path
    port: int = 0
    dp_port: int = 0

    def client(self, **kw):
        from rollout_sidecar.client import GenerationClient

        return GenerationClient(self.url, token=self.api_token, **kw)


def start_server(tmp: Path, name: str, extra_env: dict | None = None,
                 model: Path | str | None = None, dtype: str | None = None,
                 like: Server | None = None, max_model_len: int | None = 512) -> Server:
    """A real server on free ports; `like` restarts one on its ports and tokens."""
    cache = Path(os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE", tmp / "cache"))
    env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(cache), "VLLM_CPU_KVCACHE_SPACE": "1",
           "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "3",
           # Each torchrun worker is a new trainer: no waiting out the last one's lease.
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "1",
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    s = launch_server(log=tmp / f"{name}.log", model=model, dtype=dtype,
                      max_model_len=max_model_len or None, env=env,
                      port=like.port if like else None,
                      data_plane_port=like.dp_port if like else None,
                      api_token=like.api_token if like else None,
                      admin_token=like.admin_token if like else None, ready_timeout_s=300)
    with s.stopped_on_error():
        model_path = Path(s.info()["model"])
    return Server(s.url, s.api_token, s.admin_token, model_path, s.proc, s.log, s.port,
                  s.data_plane_port)


def run_torchrun(worker: Path, args: list[str], srv: Server, nproc: int = 2) -> None:
    """`worker` under torchrun (gloo ranks on this machine), with `srv`'s
    tokens in the environment and the repo importable; fails the test with
    the ranks' output if any rank fails."""
    proc = processes.run(
        processes.torchrun(worker, args, nproc),
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                     [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                 ROLLOUT_SIDECAR_ADMIN_TOKEN=srv.admin_token,
                 ROLLOUT_SIDECAR_API_TOKEN=srv.api_token),
        timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def stop_server(server: Server) -> None:
    stop_process(server.proc)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"), "server")
    yield s
    stop_server(s)


# Folders whose tests start a real engine, torchrun ranks or Docker: marked
# `e2e`, so `tests/run.sh --fast` (-m "not e2e") leaves them out. A test
# elsewhere that takes a server fixture is marked too.
E2E_DIRS = {"e2e", "fidelity", "reliability", "compose", "integrations"}
SERVER_FIXTURES = {"server", "reliable"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(REPO / "tests")
        if rel.parts[0] in E2E_DIRS or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
