"""Every file path and every code identifier the README and docs/ name in
backticks exists: ours in the repository, vLLM's, torch's and TRL's in the
installed packages, another project's on a short list that says whose. Beside
tests/test_doc_links.py, which checks the links; together docs cannot drift
from the code unnoticed (issue 28: a doc named a module that no longer
existed, another described a function that had moved)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.test_doc_links import prose

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OURS = ("server/", "client/", "trainer/", "tests/", "docs/", "bench/", "examples/", "deploy/",
        "helm/", ".ci/")
# Installed packages whose source the docs cite (by path or by name).
THEIRS = ("vllm", "torch", "trl", "transformers", "peft", "accelerate")
# Named in the docs, defined in projects we do not install.
ELSEWHERE = {
    "AgentLoop": "verl", "InferenceRouter": "SkyRL", "broadcast_to_vllm": "OpenRLHF",
    "meta_info": "SGLang", "vllm_server_url": "TRL's AsyncGRPO (trl.experimental)",
    "handleException": "torch's C++ ProcessGroupNCCL",
    "NCCL_ASYNC_ERROR_HANDLING": "NCCL (the variable Ray sets)",
    "stale_j": "a symbol of async-rl.md's formula",
    "my-values.yaml": "deploy.md: the user's own values file",
    "report.json": "the demo's output (demo --out-dir)",
    "/openapi.json": "a route (FastAPI's)",
}
IDENT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.?(\(\))?")
PATH = re.compile(r"(/?[\w.\-/]+?\.(?:py|sh|toml|yaml|yml|md|json|txt|tpl))"
                  r"(?:(::|:)([\w.\[\]\-]+))?")


def backticked(doc: Path) -> list[str]:
    return sorted(set(re.findall(r"`([^`\n]+)`", prose(doc))))


@cache
def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return [f for f in out if (REPO / f).is_file()]


@cache
def our_words() -> frozenset[str]:
    words: set[str] = set()
    for f in tracked():
        if not f.endswith(".md"):
            words |= set(re.findall(r"[A-Za-z_]\w*", (REPO / f).read_text(errors="ignore")))
    return frozenset(words)


@cache
def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and \
        spec.submodule_search_locations else None


def in_packages(words: set[str]) -> set[str]:
    """Which of `words` occur, as whole words, in the installed packages' source."""
    dirs = [str(d) for d in map(package_dir, THEIRS) if d is not None]
    if not words or not dirs:
        return set()
    found = subprocess.run(["grep", "-rhowF", "--include=*.py", *(f"-e{w}" for w in words),
                            *dirs], capture_output=True, text=True).stdout.split()
    return set(found) & words


def looks_like_code(token: str) -> bool:
    """An identifier, not a word of prose or a JSON value: it has an
    underscore, a dot or an inner capital (`keep`, `wait` are values)."""
    if not IDENT.fullmatch(token) or re.fullmatch(r"[\w.\-]+\.(py|sh|toml|yaml|md)", token):
        return False
    return "." in token or "_" in token or bool(re.search(r"[a-z][A-Z]|^[A-Z][a-z]+[A-Z]", token))


def missing_path(token: str) -> str | None:
    m = PATH.fullmatch(token)
    if m is None:
        if token.startswith(OURS) and token.endswith("/") or token.rstrip("/") in (
                "tests/e2e", "tests/fidelity", "tests/reliability", "helm/rollout-sidecar"):
            return None if (REPO / token).is_dir() else "no such folder"
        return None
    path, sep, symbol = m.groups()
    if token in ELSEWHERE or path in ELSEWHERE:
        return None
    if path.startswith(THEIRS_PATHS):
        root = package_dir(path.split("/")[0])
        target = root.parent / path if root else None
        return None if target is None or target.exists() else "not in the installed package"
    if path.startswith(OURS):
        target = REPO / path
    else:  # a file name, or a path relative to a folder the text names
        hits = [f for f in tracked() if f == path or f.endswith("/" + path)]
        if not hits:
            return "no such file"
        target = REPO / hits[0]
    if not target.exists():
        return "no such file"
    if symbol and re.fullmatch(r"\d+(-\d+)?", symbol):
        last = int(symbol.split("-")[-1])
        if last > len(target.read_text().splitlines()):
            return f"{target.name} has fewer than {last} lines"
    elif symbol and symbol.split("[")[0].split(".")[-1] not in target.read_text():
        return f"no {symbol} in it"
    return None


THEIRS_PATHS = tuple(f"{p}/" for p in THEIRS)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_path_named_exists(doc: Path) -> None:
    broken = {t: why for t in backticked(doc) if (why := missing_path(t))}
    assert not broken, broken


def test_every_identifier_named_exists() -> None:
    named: dict[str, set[str]] = {}  # part -> the tokens naming it
    for doc in DOCS:
        for token in filter(looks_like_code, backticked(doc)):
            env = re.fullmatch(r"ROLLOUT_SIDECAR_(\w+)", token)
            parts = [env.group(1).lower()] if env else \
                [p for p in token.rstrip("()").strip(".").split(".") if p]
            for part in parts:
                if part not in ELSEWHERE:
                    named.setdefault(part, set()).add(f"{doc.name}: `{token}`")
    unknown = set(named) - our_words()
    unknown -= in_packages(unknown)
    assert not unknown, sorted(t for part in unknown for t in named[part])
