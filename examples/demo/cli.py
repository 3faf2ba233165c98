"""`rollout-sidecar demo`: a command the server's CLI finds through the
`rollout_sidecar.commands` entry-point group (pyproject.toml), so that the
server never imports the demo. Light at import: typer only; the launcher and
the loop are imported when the command runs."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    steps: int = typer.Option(12, help="Optimizer steps."),
    model: str | None = typer.Option(None, help="HF checkpoint; default: embedded model."),
    nproc: int = typer.Option(2, help="Trainer ranks (torchrun, FSDP2)."),
    server_url: str | None = typer.Option(
        None, envvar="ROLLOUT_SIDECAR_URL", help="Use this server instead of starting one."),
    out_dir: Path = typer.Option(Path("demo-report"), help="Where the run report goes."),
    push: bool = typer.Option(True, help="Push weights after every step (off: ablation)."),
    seed: int = typer.Option(0),
    lm_head_fp32: bool = typer.Option(
        False, help="Started server and trainer compute the lm_head in fp32."),
    async_rollouts: bool = typer.Option(
        False, "--async", help="Generate step t+1's rollouts while step t trains and pushes "
        "(commit policy keep; per-token versions from the spans; docs/async-rl.md)."),
) -> None:
    """The online RL loop on the sidecar: FSDP2 trainer, rollouts, a push per step."""
    from rollout_sidecar.demo.launcher import launch_demo

    raise typer.Exit(launch_demo(steps=steps, model=model, nproc=nproc, server_url=server_url,
                                 out_dir=out_dir, push=push, seed=seed,
                                 lm_head_fp32=lm_head_fp32, async_rollouts=async_rollouts))
