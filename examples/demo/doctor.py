"""`rollout-sidecar doctor`: the first thing to run on a new host (docs/gpu.md).

It starts the server exactly as `serve` would (every `serve` flag, passed on
through the environment), then, in this process, plays a trainer: forms the
weight data plane (NCCL when this process has a GPU of its own, gloo
otherwise: NCCL refuses two ranks of one group on one GPU), pushes the
checkpoint's weights, moved by a seeded step, and probes the served logprobs
against them.
Each step prints what it found; the first that fails names itself and the
command exits 1. A command of the demo package, since it uses both the server
(to start it) and the trainer (to push), which never import each other.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollout_sidecar.server.cli_options import with_settings_flags
from rollout_sidecar.server.config import ENV_PREFIX, FLAG_ONLY


class Failed(Exception):
    pass


def _step(name: str, run: Callable[[], str]) -> Any:
    t0 = time.monotonic()
    try:
        found = run()
    except Exception as e:
        typer.echo(f"FAIL  {name} ({time.monotonic() - t0:.1f}s): {type(e).__name__}: {e}")
        raise Failed(name) from e
    typer.echo(f"ok    {name} ({time.monotonic() - t0:.1f}s): {found}")


def _platform() -> str:
    import torch
    import vllm
    from vllm.platforms import current_platform

    gpus = torch.cuda.device_count() if current_platform.is_cuda_alike() else 0
    name = current_platform.get_device_name(0) if gpus else "no GPU (vLLM-CPU)"
    return f"vLLM {vllm.__version__}, torch {torch.__version__}, {name} x {gpus}"


def _env(overrides: dict[str, Any]) -> dict[str, str]:
    """`serve`'s flags as its environment variables (settings read both),
    but for the flag-only ones (`_flags`)."""
    return {ENV_PREFIX + k.upper(): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in overrides.items() if k not in FLAG_ONLY}


def _flags(overrides: dict[str, Any]) -> list[str]:
    return [a for k, v in overrides.items() if k in FLAG_ONLY
            for a in (f"--{k.replace('_', '-')}", str(v))]


def run_doctor(overrides: dict[str, Any]) -> int:
    from rollout_sidecar.server.launcher import launch_server

    typer.echo("rollout-sidecar doctor: start the engine, form the data plane, push once, "
               "probe")
    state: dict[str, Any] = {}
    log = Path(tempfile.mkdtemp(prefix="rollout-sidecar-doctor-")) / "server.log"
    try:
        _step("platform", _platform)

        def start() -> str:
            state["server"] = s = launch_server(log=log, env=_env(overrides),
                                                args=_flags(overrides),
                                                ready_timeout_s=1800)
            defaults = [ln.split("engine defaults: ", 1)[1] for ln in
                        log.read_text(errors="replace").splitlines()
                        if "engine defaults: " in ln]
            return f"{s.url} ready; {defaults[-1] if defaults else 'defaults not logged'}"

        _step("engine start", start)
        server = state["server"]

        def weights() -> str:
            import httpx

            st = httpx.get(server.url + "/weights/status", timeout=30, headers={
                "Authorization": f"Bearer {server.admin_token}"}).json()
            state["status"] = st
            return (f"dtype {st['dtype']}, transports {st['transports']}, data-plane ranks "
                    f"{st['data_plane_ranks']}, version {st['weight_version']}")

        _step("weight routes", weights)
        _step("push and probe", lambda: _push(server, state))
    except Failed:
        if "server" in state:
            typer.echo(f"server log: {log}")
        return 1
    finally:
        if "server" in state:
            state["server"].stop()
    typer.echo("all checks passed")
    return 0


def _push(server: Any, state: dict[str, Any]) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    st = state["status"]
    # A GPU the server's workers do not use: CUDA_VISIBLE_DEVICES decides for both.
    spare = torch.cuda.is_available() and torch.cuda.device_count() > st["data_plane_ranks"] \
        and "nccl" in st["transports"]
    backend = "nccl" if spare else "gloo"
    device = f"cuda:{torch.cuda.device_count() - 1}" if spare else "cpu"
    if spare:
        torch.cuda.set_device(torch.device(device))
    info_model = server.info()["model"]
    model = AutoModelForCausalLM.from_pretrained(info_model, dtype=torch.float32).to(device)
    # Moved off the checkpoint, so a push that did not land (or landed in
    # part) cannot pass the probe by serving the checkpoint it started from.
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=device) * p.std() * 0.1)
    pusher = WeightPusher(server.url, admin_token=server.admin_token, transport=backend)
    try:
        r = pusher.push(model, version=st["weight_version"] + 1, probe=True)
    finally:
        pusher.close()
    p = r.probe
    assert p is not None  # probe=True
    return (f"{backend} from {device}: version {r.version}, {r.nbytes / 2**20:.1f} MiB "
            f"({r.encoding}) in {r.timings.get('total_s', float('nan')):.2f}s; probe mean "
            f"|dlogp| {p.mean_abs_dlogp:.2e} over {p.tokens} tokens (tolerance "
            f"{p.tolerance:.2g})")


def _doctor(overrides: dict[str, Any]) -> None:
    """Start the engine as `serve` would, push the checkpoint's weights once from a
    trainer in this process, probe them, and print what each step found."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    raise typer.Exit(run_doctor(overrides))


doctor = with_settings_flags(_doctor)
