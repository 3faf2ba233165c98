"""`rollout-sidecar demo`: start a server (unless given one), then the trainer
under torchrun, and return the trainer's exit code.

The server starts through the shared launcher (rollout_sidecar.server.launcher)
and the trainer starts at once, without waiting for /ready: its imports and
model load overlap the server's start, and its rank 0 waits for /ready itself.
Should the server exit meanwhile, the trainer is stopped and the server log's
tail printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rollout_sidecar.server.launcher import (
    ADMIN_TOKEN_ENV,
    API_TOKEN_ENV,
    ServerProcess,
    ServerStartError,
    launch_server,
    stop_process,
)


def _default_model_path() -> Path:
    # Deterministic recipe: the trainer and a server elsewhere build the very
    # same weights, so neither has to ship the checkpoint to the other.
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.model.default_model import ensure_default_model

    return ensure_default_model(ServerSettings().cache_dir)


def launch_demo(steps: int, model: str | None, nproc: int, server_url: str | None,
                out_dir: Path, push: bool, seed: int, lm_head_fp32: bool = False,
                async_rollouts: bool = False) -> int:
    t0 = time.monotonic()
    model_path = Path(model) if model else _default_model_path()
    env = dict(os.environ)
    server = None
    if server_url is None:
        log = out_dir / "server.log"
        server = launch_server(
            log=log, model=model_path, wait=False,
            # Tokens already in the environment are used (the trainer reads them there).
            api_token=env.get(API_TOKEN_ENV), admin_token=env.get(ADMIN_TOKEN_ENV),
            env={"ROLLOUT_SIDECAR_LM_HEAD_FP32": "1"} if lm_head_fp32 else None)
        server_url, env = server.url, server.env
        print(f"starting the server on {server_url} (log: {log})", flush=True)
    # The rendezvous port is bound by torchrun's agent itself (127.0.0.1:0): a
    # port picked here and bound later could be taken in between (two demos
    # side by side, or anything else on the machine).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "--local-addr", "127.0.0.1", "-m", "rollout_sidecar.demo.loop",
           "--url", server_url, "--model", str(model_path), "--steps", str(steps),
           "--out", str(out_dir), "--seed", str(seed)] + ([] if push else ["--no-push"]) + (
               ["--async-rollouts"] if async_rollouts else [])
    trainer = subprocess.Popen(cmd, env=env)
    try:
        code = _wait(trainer, server)
    finally:
        stop_process(trainer)
        t_trained = time.monotonic()
        if server is not None:
            server.stop()
    print(f"demo: {time.monotonic() - t0:.0f}s in all (trainer done at {t_trained - t0:.0f}s"
          + (f", server stopped in {time.monotonic() - t_trained:.1f}s)" if server else ")"),
          flush=True)
    return code


def _wait(trainer: subprocess.Popen, server: ServerProcess | None) -> int:
    """The trainer's exit code; 1 (and the server log's tail) if the server exits first."""
    while True:
        try:
            return trainer.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if server is not None:
            try:
                server.check_alive()
            except ServerStartError as e:
                print(f"the server stopped before the trainer finished: {e}", file=sys.stderr,
                      flush=True)
                return 1
