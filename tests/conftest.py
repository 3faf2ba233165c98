"""Shared fixtures: one real vLLM CPU server per test session."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port, dp_port = (like.port, like.dp_port) if like else (free_port(), free_port())
    api, admin = (like.api_token, like.admin_token) if like else (secrets.token_hex(8),
                                                                   secrets.token_hex(8))
    cache = Path(os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE", tmp / "cache"))
    env = {**os.environ, "ROLLOUT_SIDECAR_API_TOKEN": api, "ROLLOUT_SIDECAR_ADMIN_TOKEN": admin,
           "ROLLOUT_SIDECAR_CACHE_DIR": str(cache), "VLLM_CPU_KVCACHE_SPACE": "1",
           "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "3",
           # Each torchrun worker is a new trainer: no waiting out the last one's lease.
           "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "1",
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    log = tmp / f"{name}.log"
    extra = (["--model", str(model)] if model else []) + (["--dtype", dtype] if dtype else [])
    extra += ["--max-model-len", str(max_model_len)] if max_model_len else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_sidecar.server.cli", "serve", "--port", str(port),
         "--data-plane-port", str(dp_port), *extra],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(1)
    else:
        proc.kill()
        raise RuntimeError(f"server not ready:\n{log.read_text()[-4000:]}")
    model = Path(httpx.get(url + "/info", headers={
        "Authorization": f"Bearer {env['ROLLOUT_SIDECAR_API_TOKEN']}"}).json()["model"])
    return Server(url, api, admin, model, proc, log, port, dp_port)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"), "server")
    yield s
    stop_server(s)
