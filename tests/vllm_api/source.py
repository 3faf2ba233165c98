"""A vLLM source tree, read with ast (nothing imported: a GPU wheel's source
reads on a CPU machine): does a module, name, attribute or keyword exist?

Answers are True, False or None ("cannot tell": a class whose bases are
outside vLLM, a value, a lazily exported name). Names re-exported by an
import are followed; a class's attributes are its methods, class-level
assignments and annotations, and whatever a method assigns to `self.X`,
along its bases inside vLLM; a constructor's keywords are its `__init__`'s
or, with none, its (and its bases') annotated fields: a dataclass.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Obj:
    kind: str  # module | class | function | value | lazy
    module: str  # the module it lives in
    node: ast.AST | None = None


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root  # holds the `vllm` package

    @functools.cache  # noqa: B019 - one tree per check, kept for its life
    def _parse(self, module: str) -> ast.Module | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return ast.parse(path.read_text(errors="replace"), str(path))
        return None

    def _is_package(self, module: str) -> bool:
        return (self.root.joinpath(*module.split(".")) / "__init__.py").is_file()

    # ------------------------------------------------------------- resolve

    def resolve(self, dotted: str) -> Obj | None:
        """A dotted name: the longest module prefix, then names in it."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if self._parse(module) is not None:
                obj: Obj | None = Obj("module", module)
                for name in parts[cut:]:
                    if obj is None or obj.kind != "module":
                        return None if obj is None or obj.kind != "class" else \
                            (obj if self.has_attr(obj, name) else None)
                    obj = self.name_in(obj.module, name)
                return obj
        return None

    def name_in(self, module: str, name: str) -> Obj | None:
        tree = self._parse(module)
        if tree is None:
            return None
        found = _top_level(tree).get(name)
        if isinstance(found, ast.ClassDef):
            return Obj("class", module, found)
        if isinstance(found, ast.FunctionDef | ast.AsyncFunctionDef):
            return Obj("function", module, found)
        if isinstance(found, ast.ImportFrom):
            src = _absolute(module, found, self._is_package(module))
            alias = next(a for a in found.names if (a.asname or a.name) == name)
            return self.resolve(f"{src}.{alias.name}") if src else None
        if isinstance(found, ast.Import):
            alias = next(a for a in found.names if (a.asname or a.name.split(".")[0]) == name)
            return Obj("module", alias.name if alias.asname else name)
        if found is not None:
            return Obj("value", module, found)
        if self._parse(f"{module}.{name}") is not None:
            return Obj("module", f"{module}.{name}")
        if "__getattr__" in _top_level(tree) and name in _strings(tree):
            target = _lazy_target(tree, name)  # {"Name": ".module:Name"}, as vllm/__init__
            if target is not None:
                mod, _, attr = target.partition(":")
                base = module if mod.startswith(".") and self._is_package(module) else None
                full = f"{base}{mod}" if base else mod
                found = self.resolve(f"{full}.{attr}")
                if found is not None:
                    return found
            return Obj("lazy", module)
        return None

    # ----------------------------------------------------------- attributes

    def has_attr(self, obj: Obj, attr: str) -> bool | None:
        if obj.kind == "module":
            return self.name_in(obj.module, attr) is not None
        if obj.kind != "class":
            return None
        unknown = False
        for cls in self._mro(obj):
            if cls is None:
                unknown = True
            elif attr in _members(cls.node):
                return True
        return None if unknown else False

    def _mro(self, obj: Obj) -> list[Obj | None]:
        """The class and its bases inside vLLM, depth first; None for a base
        outside it (what it holds cannot be told)."""
        out: list[Obj | None] = [obj]
        assert isinstance(obj.node, ast.ClassDef)
        for base in obj.node.bases:
            text = ast.unparse(base).split("[")[0]
            if text in ("object", "Generic", "ABC", "Protocol"):
                continue
            head, _, rest = text.partition(".")
            found = self.name_in(obj.module, head)
            if found is not None and rest and found.kind == "module":
                found = self.resolve(f"{found.module}.{rest}")
            out += self._mro(found) if found is not None and found.kind == "class" else [None]
        return out

    # ------------------------------------------------------------- keywords

    def missing_keywords(self, obj: Obj, attr: str | None, keywords: list[str]
                         ) -> list[str] | None:
        """Keywords the call would not accept; None if it cannot be told."""
        fn: ast.AST | None = None
        fields: set[str] = set()
        if attr is None and obj.kind == "function":
            fn = obj.node
        elif obj.kind == "class":
            name = "__init__" if attr is None else attr
            mro = self._mro(obj)
            field_style = any(c is not None and _field_style(c.node) for c in mro)
            for cls in mro:
                if cls is None:
                    if attr is None and field_style:
                        continue  # a TypedDict, msgspec Struct or pydantic model: its fields
                    return None
                member = _members(cls.node).get(name)
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    fn = member
                    break
                if attr is None:
                    fields |= _fields(cls.node)
            if fn is None and attr is None:
                return [k for k in keywords if k not in fields]
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        a = fn.args
        if a.kwarg is not None:
            return []
        names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        return [k for k in keywords if k not in names]


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}

    def add(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = node
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    names[a.asname or a.name] = node
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = node
            elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING, fallbacks
                add(node.body)
                add(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    add(h.body)

    add(tree.body)
    return names


@functools.cache
def _members(node: ast.ClassDef) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = dict(_top_level(ast.Module(body=node.body, type_ignores=[])))
    for fn in node.body:
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for n in ast.walk(fn):
                target = n.target if isinstance(n, ast.AnnAssign) else None
                targets = n.targets if isinstance(n, ast.Assign) else [target] if target else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                        out.setdefault(t.attr, n)
    return out


def _field_style(node: ast.AST | None) -> bool:
    """Whether a class is built from its annotated fields by an outside base."""
    return isinstance(node, ast.ClassDef) and any(
        ast.unparse(b).split("[")[0].split(".")[-1] in ("TypedDict", "Struct", "BaseModel")
        for b in node.bases)


def _fields(node: ast.ClassDef) -> set[str]:
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name) and "ClassVar" not in ast.unparse(n.annotation)}


def _lazy_target(tree: ast.Module, name: str) -> str | None:
    for d in ast.walk(tree):
        if isinstance(d, ast.Dict):
            for k, v in zip(d.keys, d.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == name and isinstance(
                        v, ast.Constant) and isinstance(v.value, str) and ":" in v.value:
                    return v.value
    return None


def _strings(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    if keep <= 0:
        return None
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base
