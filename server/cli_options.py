"""`serve`'s flags, derived from `ServerSettings` so that every setting is a
flag, with its real default and its environment variable in `--help`, and a
new setting needs no CLI code. Enumerations are choices, so a typo is a
usage error, not a traceback at engine start."""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rollout_sidecar.server.config import ENV_PREFIX, FLAG_ONLY, ServerSettings


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    if default is None or default is PydanticUndefined:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, Path) and str(default).startswith(str(Path.home())):
        return "~" + str(default)[len(str(Path.home())):]
    return str(default)


def _parameter(name: str, field: FieldInfo) -> inspect.Parameter:
    kind: Any = _unwrap(field.annotation)
    flag = "--" + name.replace("_", "-")
    env = ENV_PREFIX + name.upper()
    # Parentheses, not brackets: rich would read [..] as markup.
    source = "flag only" if name in FLAG_ONLY else f"env {env}"
    help_text = f"{field.description or ''} ({source}; default: {_default_text(field)})"
    option: Any
    if kind is bool:
        option = typer.Option(None, f"{flag}/--no-{name.replace('_', '-')}", help=help_text,
                              show_default=False)
    elif typing.get_origin(kind) is typing.Literal:
        option = typer.Option(None, flag, help=help_text, show_default=False,
                              case_sensitive=False)
        choices = [str(a) for a in typing.get_args(kind)]
        kind = enum.Enum(name, {c: c for c in choices}, type=str)  # type: ignore[misc,no-redef]
    else:
        option = typer.Option(None, flag, help=help_text, show_default=False)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=kind | None)


def settings_parameters() -> list[inspect.Parameter]:
    """One flag per setting, except secrets: tokens come from the environment
    only, so they stay out of process listings and shell history."""
    return [_parameter(name, f) for name, f in ServerSettings.model_fields.items()
            if _unwrap(f.annotation) is not SecretStr]


def with_settings_flags(command: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
    """Wrap `command(overrides)` into a typer command taking one flag per setting;
    only the flags given on the command line override the environment."""

    def wrapper(**flags: Any) -> None:
        command({k: v.value if isinstance(v, enum.Enum) else v
                 for k, v in flags.items() if v is not None})

    wrapper.__signature__ = inspect.Signature(settings_parameters())  # type: ignore[attr-defined]
    wrapper.__doc__ = command.__doc__
    wrapper.__name__ = command.__name__
    return wrapper
