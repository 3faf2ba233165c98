"""`rollout-sidecar demo`: start a server (unless given one), then the trainer
under torchrun, and return the trainer's exit code."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_model_path() -> Path:
    # Deterministic recipe: the trainer and a server elsewhere build the very
    # same weights, so neither has to ship the checkpoint to the other.
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.model.default_model import ensure_default_model

    return ensure_default_model(ServerSettings().cache_dir)


def launch_demo(steps: int, model: str | None, nproc: int, server_url: str | None,
                out_dir: Path, push: bool, seed: int, lm_head_fp32: bool = False) -> int:
    model_path = Path(model) if model else _default_model_path()
    env = dict(os.environ)
    server = None
    if server_url is None:
        env.setdefault("ROLLOUT_SIDECAR_API_TOKEN", secrets.token_hex(16))
        env.setdefault("ROLLOUT_SIDECAR_ADMIN_TOKEN", secrets.token_hex(16))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if lm_head_fp32:
            env["ROLLOUT_SIDECAR_LM_HEAD_FP32"] = "1"
        port = _free_port()
        server_url = f"http://127.0.0.1:{port}"
        log = out_dir / "server.log"
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"starting the server on {server_url} (log: {log})", flush=True)
        server = subprocess.Popen(
            [sys.executable, "-m", "rollout_sidecar.server.cli", "serve", "--model",
             str(model_path), "--port", str(port), "--data-plane-port", str(_free_port())],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", "rollout_sidecar.demo.loop",
           "--url", server_url, "--model", str(model_path), "--steps", str(steps),
           "--out", str(out_dir), "--seed", str(seed)] + ([] if push else ["--no-push"])
    try:
        return subprocess.call(cmd, env=env)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
