"""`rollout-sidecar`: serve, build the default model, run the demo."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A vLLM generation server for RL post-training.")
model_app = typer.Typer(no_args_is_help=True, help="The embedded default model.")
app.add_typer(model_app, name="model")


@app.command()
def serve(
    model: str | None = typer.Option(None, help="Local HF checkpoint; default: embedded model."),
    host: str | None = typer.Option(None, help="Bind address [env ROLLOUT_SIDECAR_HOST]."),
    port: int | None = typer.Option(None, help="HTTP port [env ROLLOUT_SIDECAR_PORT]."),
    dtype: str | None = typer.Option(None, help="Serving dtype."),
    lm_head_fp32: bool | None = typer.Option(
        None, "--lm-head-fp32/--no-lm-head-fp32",
        help="Compute the lm_head in fp32 [env ROLLOUT_SIDECAR_LM_HEAD_FP32]."),
    max_model_len: int | None = typer.Option(None),
    gpu_memory_utilization: float | None = typer.Option(None),
    commit_policy: str | None = typer.Option(None, help="wait | abort | keep."),
    data_plane_port: int | None = typer.Option(None, help="TCPStore port for pushes."),
    cache_dir: Path | None = typer.Option(None, help="Where the default model is built."),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve POST /generate and the weight routes. Tokens come from the
    environment only (ROLLOUT_SIDECAR_API_TOKEN, ROLLOUT_SIDECAR_ADMIN_TOKEN),
    never from flags, so they stay out of process listings."""
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.serve import run_server

    overrides: dict[str, Any] = {k: v for k, v in dict(
        model=model, host=host, port=port, dtype=dtype, lm_head_fp32=lm_head_fp32,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, commit_policy=commit_policy,
        data_plane_port=data_plane_port, cache_dir=cache_dir,
    ).items() if v is not None}
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(ServerSettings(**overrides), log_level=log_level)


@model_app.command("init")
def model_init(out: Path = typer.Argument(..., help="Directory to write the checkpoint to.")
               ) -> None:
    """Write the deterministic default checkpoint (Llama, byte tokenizer) to OUT."""
    from rollout_sidecar.server.default_model import write_default_model

    path = write_default_model(out)
    typer.echo(f"wrote {path}")


@app.command()
def demo(
    steps: int = typer.Option(20, help="Optimizer steps."),
    model: str | None = typer.Option(None, help="HF checkpoint; default: embedded model."),
    nproc: int = typer.Option(2, help="Trainer ranks (torchrun, FSDP2)."),
    server_url: str | None = typer.Option(
        None, envvar="ROLLOUT_SIDECAR_URL", help="Use this server instead of starting one."),
    out_dir: Path = typer.Option(Path("demo-report"), help="Where the run report goes."),
    push: bool = typer.Option(True, help="Push weights after every step (off: ablation)."),
    seed: int = typer.Option(0),
    lm_head_fp32: bool = typer.Option(
        False, help="Started server and trainer compute the lm_head in fp32."),
) -> None:
    """The online RL loop on the sidecar: FSDP2 trainer, rollouts, a push per step."""
    from rollout_sidecar.trainer.demo_launcher import launch_demo

    raise typer.Exit(launch_demo(steps=steps, model=model, nproc=nproc, server_url=server_url,
                                 out_dir=out_dir, push=push, seed=seed,
                                 lm_head_fp32=lm_head_fp32))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
