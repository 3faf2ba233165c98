"""What of vLLM our code uses, read from its source (ast, nothing imported):
every `vllm` import, every attribute read off a name those imports bind or
off a handle that holds a vLLM object (`HANDLES`), and the keywords of every
call of those. Imports inside a `try` that catches ImportError are
alternatives: one of them must resolve (a compatibility fallback).

And every member of the protocols in `SURFACES` (the server's typed surface
of vLLM), against the vLLM class its module's `STANDS_FOR` names: a method's
named parameters as the keywords of a call.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

# Expressions in our code that hold a vLLM object, by its class. A name that
# means something else in some file would show up as a false "gone" against
# the installed vLLM, which tests/test_vllm_api_units.py checks stays clean.
ASYNC_LLM = "vllm.v1.engine.async_llm.AsyncLLM"
HANDLES = {
    **dict.fromkeys(["self.llm", "self.engine.llm", "e.llm", "engine.llm", "llm"], ASYNC_LLM),
    "worker": "vllm.v1.worker.gpu_worker.Worker",
    **dict.fromkeys(["pc", "parallel_config", "self.parallel_config",
                     "vllm_config.parallel_config", "config.vllm_config.parallel_config"],
                    "vllm.config.parallel.ParallelConfig"),
    **dict.fromkeys(["mc", "self.model_config", "self.llm.model_config",
                     "vllm_config.model_config"], "vllm.config.model.ModelConfig"),
    **dict.fromkeys(["vllm_config.cache_config"], "vllm.config.cache.CacheConfig"),
    **dict.fromkeys(["vllm_config", "self.llm.vllm_config", "config.vllm_config"],
                    "vllm.config.vllm.VllmConfig"),
    "current_platform": "vllm.platforms.interface.Platform",
}
SCANNED = ("server", "client", "trainer", "examples")
SURFACES = ("server/engine/vllm_surface.py", "server/weights/worker/vllm_worker.py")


@dataclass
class Use:
    where: str  # file:line
    target: str  # "vllm.x.y" (a module or a name in one) or "vllm.x.Class"
    attr: str | None = None  # an attribute of target
    keywords: list[str] = field(default_factory=list)  # of a call of target(.attr)
    group: tuple[str, int] | None = None  # alternatives: one use of a group must resolve

    def __str__(self) -> str:
        what = self.target + (f".{self.attr}" if self.attr else "")
        kw = f"({', '.join(k + '=' for k in self.keywords)})" if self.keywords else ""
        return f"{self.where}: {what}{kw}"


def _falls_back(node: ast.Try) -> bool:
    names = []
    for h in node.handlers:
        t = h.type
        names += [ast.unparse(e) for e in (t.elts if isinstance(t, ast.Tuple) else [t])] if t \
            else ["*"]
    return any(n in ("ImportError", "ModuleNotFoundError", "*") for n in names)


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.bound: dict[str, str] = {}  # local name -> what it is in vLLM
        self.uses: list[Use] = []
        self.group: tuple[str, int] | None = None
        self.groups = 0

    def _at(self, node: ast.AST) -> str:
        return f"{self.path}:{getattr(node, 'lineno', 0)}"

    def visit_Try(self, node: ast.Try) -> None:
        if not _falls_back(node):
            return self.generic_visit(node)
        self.groups += 1
        outer, self.group = self.group, (self.path, self.groups)
        self.generic_visit(node)
        self.group = outer

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "vllm" or a.name.startswith("vllm."):
                self.uses.append(Use(self._at(node), a.name, group=self.group))
                self.bound[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level == 0 and (mod == "vllm" or mod.startswith("vllm.")):
            for a in node.names:
                self.uses.append(Use(self._at(node), f"{mod}.{a.name}", group=self.group))
                self.bound[a.asname or a.name] = f"{mod}.{a.name}"

    def _base(self, expr: ast.AST) -> str | None:
        text = ast.unparse(expr)
        if text in HANDLES:
            return HANDLES[text]
        if isinstance(expr, ast.Name) and expr.id in self.bound:
            return self.bound[expr.id]
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = self._base(node.value)
        if target is not None:
            self.uses.append(Use(self._at(node), target, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        kws = [k.arg for k in node.keywords if k.arg is not None]
        f = node.func
        if kws:
            if isinstance(f, ast.Attribute) and (t := self._base(f.value)) is not None:
                self.uses.append(Use(self._at(node), t, f.attr, kws))
            elif (t := self._base(f)) is not None:
                self.uses.append(Use(self._at(node), t, None, kws))
        self.generic_visit(node)


def surface(root: Path, path: str) -> list[Use]:
    """Every member of every protocol `STANDS_FOR` maps to a vLLM class."""
    tree = ast.parse((root / path).read_text(), path)
    stands_for: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "STANDS_FOR":
            assert isinstance(node.value, ast.Dict)
            stands_for = {ast.unparse(k): ast.literal_eval(v)
                          for k, v in zip(node.value.keys, node.value.values, strict=True)
                          if k is not None}
    uses: list[Use] = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in stands_for:
            continue
        for member in node.body:
            at = f"{path}:{member.lineno}"
            if isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                uses.append(Use(at, stands_for[node.name], member.target.id))
            elif isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                a = member.args
                named = [x.arg for x in (*a.args[1:], *a.kwonlyargs)]
                uses.append(Use(at, stands_for[node.name], member.name, named))
    return uses


def collect(root: Path, folders: tuple[str, ...] = SCANNED) -> list[Use]:
    """Every use in the .py files under `root`/`folders`, and the surface's."""
    uses: list[Use] = [u for path in SURFACES if (root / path).is_file()
                       for u in surface(root, path)]
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            scan = _Scan(str(path.relative_to(root)))
            scan.visit(ast.parse(path.read_text(), str(path)))
            uses += scan.uses
    return uses
