"""The package's layers, checked on the source with ``ast`` (no imports run).

Layers, lowest first: ``errors.py`` <- ``models`` <- ``core`` <- ``proposers`` <- everything else
(``api.py``, ``cli.py``, ``bench``, ``server``, any other top-level module, the package's
``__init__``).  A module may import from its own layer or below, never above.

Every import statement counts: at module level, inside functions and classes, and under
``if TYPE_CHECKING:``; relative and absolute.  ``from PKG import NAME`` is an import of the
submodule ``PKG.NAME`` when there is one, else of ``PKG`` itself.

1. no import runs up the layers (type-only imports included: a name from a higher layer in a
   signature is a dependency on it too);
2. no import cycle between modules (type-only imports excluded: they never run);
3. no module imports a private name (leading underscore) from another module of the package.

Each failure prints the offending edges (module -> module, file:line).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = "leapdecode"
SRC = Path(__file__).resolve().parents[1] / "src" / PKG


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else None
    if sub == "errors":
        return 0, "errors"
    if sub == "models":
        return 1, "models"
    if sub == "core":
        return 2, "core"
    if sub == "proposers":
        return 3, "proposers"
    return 4, f"top ({sub or PKG + '/__init__'})"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    names: tuple[str, ...]  # the names imported (from X import a, b), () for ``import X``
    type_only: bool

    def __str__(self) -> str:
        what = f" ({', '.join(self.names)})" if self.names else ""
        kind = " [TYPE_CHECKING]" if self.type_only else ""
        return f"{self.src} -> {self.dst}{what}  {MODULES[self.src].relative_to(SRC.parent)}:{self.line}{kind}"


def _resolve_relative(src: str, level: int, module: str | None) -> str:
    base = src.split(".")
    if src not in PACKAGES:
        base = base[:-1]  # a module's package
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_test(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(import node, under ``if TYPE_CHECKING:``) for every import in the tree, at any depth."""
    out = []

    def visit(node, type_only):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_test(child):
                for n in child.body:
                    visit_stmt(n, True)
                for n in child.orelse:
                    visit_stmt(n, type_only)
                continue
            visit_stmt(child, type_only)

    def visit_stmt(node, type_only):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, type_only))
        visit(node, type_only)

    visit(tree, False)
    return out


def edges_of(src: str) -> list[Edge]:
    tree = ast.parse(MODULES[src].read_text(), filename=str(MODULES[src]))
    out = []
    for node, type_only in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PKG or alias.name.startswith(PKG + "."):
                    out.append(Edge(src, _known(alias.name), node.lineno, (), type_only))
            continue
        target = _resolve_relative(src, node.level, node.module) if node.level else (node.module or "")
        if not (target == PKG or target.startswith(PKG + ".")):
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            dst = sub if sub in MODULES else _known(target)
            out.append(Edge(src, dst, node.lineno, (alias.name,), type_only))
    return out


def _known(module: str) -> str:
    """The module itself, or its nearest enclosing package we know (an import of a missing module
    still depends on that package)."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


EDGES = [e for m in MODULES for e in edges_of(m) if e.dst != e.src]


def test_the_source_tree_is_found():
    assert f"{PKG}.errors" in MODULES and f"{PKG}.core.generate" in MODULES and f"{PKG}.api" in MODULES
    assert len(EDGES) > 50  # the parser sees the imports


def test_imports_never_run_up_the_layers():
    bad = [e for e in EDGES if layer(e.dst)[0] > layer(e.src)[0]]
    report = "\n".join(f"  {layer(e.src)[1]} -> {layer(e.dst)[1]}: {e}" for e in bad)
    print(report)
    assert not bad, f"{len(bad)} import(s) run up the layers (models <- core <- proposers <- top):\n{report}"


def test_errors_is_below_everything():
    bad = [e for e in EDGES if e.src == f"{PKG}.errors"]
    assert not bad, "\n".join(map(str, bad))


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_cycles():
    runtime = [e for e in EDGES if not e.type_only]
    cycles = _cycles(runtime)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append("cycle: " + ", ".join(comp))
        lines += [f"    {e}" for e in runtime if e.src in members and e.dst in members]
    report = "\n".join(lines)
    print(report)
    assert not cycles, f"{len(cycles)} import cycle(s) (function-level imports included):\n{report}"


def test_the_cycle_finder_finds_cycles():
    fake = [Edge(f"{PKG}.api", f"{PKG}.cli", 1, (), False), Edge(f"{PKG}.cli", f"{PKG}.api", 2, (), False),
            Edge(f"{PKG}.errors", f"{PKG}.api", 3, (), False)]
    assert _cycles(fake) == [sorted([f"{PKG}.api", f"{PKG}.cli"])]


def test_no_private_names_imported_from_other_modules():
    bad = [e for e in EDGES for n in e.names
           if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    report = "\n".join(f"  {e}" for e in bad)
    print(report)
    assert not bad, f"{len(bad)} import(s) of a private name from another module:\n{report}"


@pytest.mark.parametrize("src,code,dst,type_only", [
    ("leapdecode.core.generate", "from ..proposers import METHODS", "leapdecode.proposers", False),
    ("leapdecode.core.generate", "from ..proposers.registry import METHODS", "leapdecode.proposers.registry", False),
    ("leapdecode.core.generate", "from . import runner", "leapdecode.core.runner", False),
    ("leapdecode.proposers", "from .registry import METHODS", "leapdecode.proposers.registry", False),
    ("leapdecode.models.loader", "import leapdecode.core.runner", "leapdecode.core.runner", False),
    ("leapdecode.models.loader", "def f():\n    from leapdecode import api", "leapdecode.api", False),
    ("leapdecode.core.runner", "if TYPE_CHECKING:\n    from ..api import x", "leapdecode.api", True),
    ("leapdecode.core.runner", "from .. import generate", "leapdecode", False),
])
def test_the_import_parser(monkeypatch, tmp_path, src, code, dst, type_only):
    """Relative (from a module and from a package's __init__), absolute, nested and type-only imports."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\n" + code + "\n")
    monkeypatch.setitem(MODULES, src, f)
    edges = [e for e in edges_of(src) if e.dst.startswith(PKG)]
    assert [(e.dst, e.type_only) for e in edges] == [(dst, type_only)], edges
