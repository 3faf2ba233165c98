"""`rollout-sidecar`: serve, build the default model, run the demo."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from rollout_sidecar.server.cli_options import with_settings_flags

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A vLLM generation server for RL post-training.")
model_app = typer.Typer(no_args_is_help=True, help="The embedded default model.")
app.add_typer(model_app, name="model")


def serve(overrides: dict[str, Any]) -> None:
    """Serve POST /generate and the weight routes. Every setting is a flag and
    a ROLLOUT_SIDECAR_* environment variable (flags win). Tokens come from the
    environment only (ROLLOUT_SIDECAR_API_TOKEN, ROLLOUT_SIDECAR_ADMIN_TOKEN),
    never from flags, so they stay out of process listings."""
    from pydantic import ValidationError

    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.model.model_source import ModelSourceError
    from rollout_sidecar.server.serve import run_server

    try:
        settings = ServerSettings(**overrides)
    except ValidationError as e:  # out-of-range values, tokens that clash
        err = e.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        raise typer.BadParameter(err["msg"], param_hint=f"--{name.replace('_', '-')}"
                                 if name else None) from None
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_server(settings)
    except ModelSourceError as e:
        raise typer.BadParameter(str(e), param_hint=e.option) from None


app.command(name="serve")(with_settings_flags(serve))


@model_app.command("init")
def model_init(out: Path = typer.Argument(..., help="Directory to write the checkpoint to.")
               ) -> None:
    """Write the deterministic default checkpoint (Llama, byte tokenizer) to OUT."""
    from rollout_sidecar.server.model.default_model import write_default_model

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
    from rollout_sidecar.demo.launcher import launch_demo

    raise typer.Exit(launch_demo(steps=steps, model=model, nproc=nproc, server_url=server_url,
                                 out_dir=out_dir, push=push, seed=seed,
                                 lm_head_fp32=lm_head_fp32))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
