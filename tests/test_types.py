"""The server, the client and the shared layer type-check: mypy over
server/, client/ and protocol/, with vLLM's surface typed
(server/engine/vllm_surface.py) and every other seam declared. (trainer/
is not held to it yet.)

mypy reads the package as it is installed, `rollout_sidecar.server`; the
project maps that name onto the top-level folders (pyproject's
package-dir), which an editable install serves through an import hook mypy
cannot see, so the test lays the same mapping out as links in a temporary
folder. A few seconds: the libraries are not followed (pyproject's
[tool.mypy]).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "client", "trainer", "protocol")


CHECKED = ("server", "client", "protocol")


def test_the_server_client_and_protocol_type_check(tmp_path: Path):
    pytest.importorskip("mypy")
    root = tmp_path / "rollout_sidecar"
    root.mkdir()
    (root / "__init__.py").touch()
    for name in PACKAGES:
        (root / name).symlink_to(REPO / name)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"),
         *(a for name in CHECKED for a in ("-p", f"rollout_sidecar.{name}"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
