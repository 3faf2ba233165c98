"""Where the frameworks whose pins conflict with the engine's are installed
(tests/integrations/frameworks.txt, by `deploy/setup.sh --test`), and the
environment of a process that imports them."""

from __future__ import annotations

import os

import pytest

from tests import processes
from tests.conftest import REPO

FRAMEWORKS = REPO / ".venv" / "frameworks"


def framework_env(**extra: str) -> dict[str, str]:
    """`processes.repo_env` with the frameworks after the repository (whose
    `tests` package must win over any a framework wheel ships)."""
    if not (FRAMEWORKS / "verl").is_dir():
        pytest.fail(f"{FRAMEWORKS} has no verl: run `bash deploy/setup.sh --test`")
    env = processes.repo_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(FRAMEWORKS)])
    return env
