"""`rollout-sidecar`: serve, build the default model; the demo and other installed
commands join through the `rollout_sidecar.commands` entry-point group."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from rollout_sidecar.server.cli_options import with_settings_flags
from rollout_sidecar.server.config import ENV_PREFIX

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A vLLM generation server for RL post-training.")
# Entry-point group of extra commands (pyproject.toml): `demo` comes from there.
COMMANDS_GROUP = "rollout_sidecar.commands"
model_app = typer.Typer(no_args_is_help=True, help="The embedded default model.")
app.add_typer(model_app, name="model")


def serve(overrides: dict[str, Any]) -> None:
    """Serve POST /generate and the weight routes. Every setting is a flag and
    a ROLLOUT_SIDECAR_* environment variable (flags win). Tokens come from the
    environment only (ROLLOUT_SIDECAR_API_TOKEN, ROLLOUT_SIDECAR_ADMIN_TOKEN),
    never from flags, so they stay out of process listings."""
    from pydantic import ValidationError

    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.listeners import PortUnavailable
    from rollout_sidecar.server.model.model_source import ModelSourceError
    from rollout_sidecar.server.serve import run_server

    try:
        settings = ServerSettings(**overrides)
    except ValidationError as e:  # out-of-range values, empty or clashing tokens
        err = e.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        secret = ServerSettings.model_fields.get(name)
        hint = (None if not name else ENV_PREFIX + name.upper()
                if secret is not None and "SecretStr" in str(secret.annotation)
                else f"--{name.replace('_', '-')}")
        raise typer.BadParameter(err["msg"].removeprefix("Value error, "),
                                 param_hint=hint) from None
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.failpoints is not None:  # this process and its engine's workers
        from rollout_sidecar.protocol.failpoints import arm_file

        arm_file(settings.failpoints)
    if settings.headless:  # one host of an engine that node 0 serves
        from rollout_sidecar.server.engine.headless import HeadlessRefused, run_headless

        try:
            raise SystemExit(run_headless(settings))
        except HeadlessRefused as e:
            raise typer.BadParameter(str(e), param_hint="--headless") from None
    if settings.node_rank > 0:
        raise typer.BadParameter(f"node_rank {settings.node_rank}: hosts other than node 0 "
                                 "run this engine's workers with --headless",
                                 param_hint="--node-rank")
    try:
        run_server(settings)
    except (ModelSourceError, PortUnavailable) as e:
        raise typer.BadParameter(str(e), param_hint=e.option) from None


app.command(name="serve")(with_settings_flags(serve))


@app.command("drain")
def drain(url: str = typer.Option("http://127.0.0.1:8000", help="The server to drain."),
          timeout_s: float = typer.Option(
              60.0, help="How long the server waits for its work in flight (the chart: "
              "terminationGracePeriodSeconds - 10)."),
          min_s: float = typer.Option(0.0, help="Return no sooner than this (a Service's "
                                      "endpoints dropping the pod).")) -> None:
    """A replica's leave, before SIGTERM (a Kubernetes preStop): no new work, what it
    holds finished, a push begun run to its end. Token: $ROLLOUT_SIDECAR_ADMIN_TOKEN."""
    from rollout_sidecar.server.drain.command import drain_replica

    drain_replica(url, timeout_s, min_s)


@model_app.command("init")
def model_init(out: Path = typer.Argument(..., help="Directory to write the checkpoint to.")
               ) -> None:
    """Write the deterministic default checkpoint (Llama, byte tokenizer) to OUT."""
    from rollout_sidecar.server.model.default_model import write_default_model

    path = write_default_model(out)
    typer.echo(f"wrote {path}")


def add_plugin_commands(target: typer.Typer, group: str = COMMANDS_GROUP) -> list[str]:
    """Add the commands other installed packages register under the entry-point
    `group` (the demo: `rollout_sidecar.demo.cli:demo`), each a typer command
    function named by its entry point. The server imports none of them itself;
    one that fails to load is skipped with a warning, so `serve` always works."""
    from importlib.metadata import entry_points

    added = []
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        if ep.name in added:  # the same package seen twice on sys.path
            continue
        try:
            command = ep.load()
        except Exception as e:  # a broken optional package must not break `serve`
            typer.echo(f"warning: command {ep.name!r} ({ep.value}) not loaded: {e}", err=True)
            continue
        target.command(name=ep.name)(command)
        added.append(ep.name)
    return added


add_plugin_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
