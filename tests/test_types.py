"""Every package type-checks: mypy over server/, trainer/, client/,
protocol/ and the demo, with vLLM's surface typed
(server/engine/vllm_surface.py) and every other seam declared.

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


# Each package, as installed (pyproject's package-dir): its folder here.
PACKAGES = {"server": "server", "trainer": "trainer", "client": "client",
            "protocol": "protocol", "demo": "examples/demo"}


def test_every_package_type_checks(tmp_path: Path):
    pytest.importorskip("mypy")
    root = tmp_path / "rollout_sidecar"
    root.mkdir()
    (root / "__init__.py").touch()
    for name, folder in PACKAGES.items():
        (root / name).symlink_to(REPO / folder)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"),
         *(a for name in PACKAGES for a in ("-p", f"rollout_sidecar.{name}"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
