"""The packages' import rules, read from the source (every import statement,
at module level or inside a function), so a lazy import cannot hide a
dependency that a plain `import` test would miss.

    protocol  <-  client, trainer, server   (the shared layer; imports none of them)
    trainer  -/->  server, demo, client internals     server  -/->  trainer, demo, client
    client   -/->  server, trainer, demo, torch
    protocol/schema, protocol/calls  -/->  torch       (only protocol/data_plane has torch)
    server/engine  -/->  the features on it (generate, openai_api, weights, health): one
                         direction, engine <- feature; app.py wires them together

Plus the runtime check: importing a package loads none of what its docstring
says it never needs (a subprocess, so this process's imports do not count).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests import processes

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"client": "client", "trainer": "trainer", "server": "server",
            "protocol": "protocol", "demo": "examples/demo"}
# The only folder of `protocol/` (and of the client) that may import torch.
TORCH_FOLDER = "protocol/data_plane/"
# The client's internals: a trainer integration may drive rollouts through the
# client's public names (`rollout_sidecar.client`), never through its modules.
CLIENT_INTERNALS = "rollout_sidecar.client."
# Folders held to more than their package's rules.
FOLDER_FORBIDDEN = {
    "server/engine/": {f"rollout_sidecar.server.{f}"
                       for f in ("generate", "openai_api", "weights", "health", "app")},
    # The wire types need nothing of the data plane (no torch, no circle).
    "protocol/schema/": {"rollout_sidecar.protocol.data_plane"},
}
FORBIDDEN = {
    "client": {"rollout_sidecar.server", "rollout_sidecar.trainer", "rollout_sidecar.demo",
               "torch"},
    "trainer": {"rollout_sidecar.server", "rollout_sidecar.demo", "vllm", CLIENT_INTERNALS},
    "server": {"rollout_sidecar.trainer", "rollout_sidecar.demo", "rollout_sidecar.client"},
    "protocol": {"rollout_sidecar.server", "rollout_sidecar.trainer", "rollout_sidecar.client",
                 "rollout_sidecar.demo", "vllm", "torch"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file; relative ones resolved
    against the file's package."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # we use absolute imports; a relative one is resolved anyway
                parts = path.relative_to(REPO).with_suffix("").parts[:-node.level]
                out.append((node.lineno, ".".join(("rollout_sidecar", *parts,
                                                   *([node.module] if node.module else [])))))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def _under(module: str, prefix: str) -> bool:
    if prefix.endswith("."):  # a package's submodules, not the package itself
        return module.startswith(prefix)
    return module == prefix or module.startswith(prefix + ".")


def violations() -> list[str]:
    found = []
    for pkg, folder in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            rules = set(FORBIDDEN.get(pkg, ()))
            if rel.startswith(TORCH_FOLDER):
                rules.discard("torch")
            for folder_, more in FOLDER_FORBIDDEN.items():
                if rel.startswith(folder_):
                    rules |= more
            for line, module in imports_of(path):
                if bad := next((r for r in rules if _under(module, r)), None):
                    found.append(f"{rel}:{line} imports {module} ({pkg} must not import {bad})")
    return found


def test_no_package_imports_across_its_boundary():
    assert violations() == []


def test_the_rules_catch_a_crossing(tmp_path, monkeypatch):
    """The scan itself finds a lazy import inside a function."""
    fake = tmp_path / "server"
    fake.mkdir()
    (fake / "x.py").write_text("def f():\n    from rollout_sidecar.trainer import pusher\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setitem(PACKAGES, "client", "none")
    monkeypatch.setitem(PACKAGES, "trainer", "none")
    monkeypatch.setitem(PACKAGES, "demo", "none")
    monkeypatch.setitem(PACKAGES, "protocol", "none")
    assert violations() == ["server/x.py:2 imports rollout_sidecar.trainer "
                            "(server must not import rollout_sidecar.trainer)"]


@pytest.mark.parametrize("package, forbidden", [
    ("rollout_sidecar.trainer", {"vllm", "transformers", "matplotlib", "fastapi"}),
    ("rollout_sidecar.client", {"vllm", "transformers", "matplotlib", "fastapi", "torch"}),
    ("rollout_sidecar.protocol.schema", {"torch", "httpx", "vllm"}),
    ("rollout_sidecar.protocol.calls.stall_watch", {"torch", "vllm"}),
])
def test_each_package_imports_only_what_its_docstring_says(package, forbidden):
    """The demo (transformers, tqdm, matplotlib) lives in rollout_sidecar.demo."""
    code = (f"import sys, {package}; "
            f"print(sorted(m for m in {sorted(forbidden)!r} if m in sys.modules))")
    r = processes.run([sys.executable, "-c", code], timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip()
    assert out == "[]", f"{package} imports {out}"


def test_every_source_folder_is_a_listed_package():
    """A wheel carries only the packages pyproject lists; a folder left out
    imports fine from the repo but not from the Docker image's install."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    missing = []
    for package, folder in setuptools["package-dir"].items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.parent.relative_to(REPO / folder).parts
            if (name := ".".join((package, *parts))) not in listed:
                missing.append(name)
    assert sorted(set(missing)) == []
