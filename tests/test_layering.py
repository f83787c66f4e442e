"""The package's layers, checked on the source with ``ast`` (no imports run).

Layers, lowest first: ``errors.py`` < ``models`` < ``core`` < ``proposers`` and ``constraints`` <
``strategies`` < ``request.py`` < ``api.py`` < the front ends (``cli.py``, ``cli_args.py``,
``server``, ``bench``, every other top-level module, the package's ``__init__``).  A module may
import from its own layer or below, never above.  ``diffusion`` (masked-diffusion LMs, a second
product) stands apart: it imports only ``errors``, ``models``, ``core``, ``proposers`` and
``constraints`` (and itself), and only ``request``, ``api`` and the front ends import it.

Every import statement counts: at module level, inside functions and classes, and under
``if TYPE_CHECKING:``; relative and absolute.  ``from PKG import NAME`` is an import of the
submodule ``PKG.NAME`` when there is one, else of ``PKG`` itself.

1. no import runs up the layers (type-only imports included: a name from a higher layer in a
   signature is a dependency on it too);
2. no import cycle between modules (type-only imports excluded: they never run);
3. no module imports a private name (leading underscore) from another module of the package,
   nor reads one as an attribute of a package module it imported (``runner._entries``);
4. no module imports the package's modules by name at run time (``importlib.import_module``,
   ``__import__``): such an import hides from the checks above (``cli.py`` once loaded its
   subcommands that way, which hid an import cycle).

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


# (layer, its packages and modules), lowest first; a module may import from its layer or below
LAYERS = (
    (0, ("errors",)),
    (1, ("models",)),
    (2, ("core",)),
    (3, ("proposers", "constraints")),
    (4, ("strategies",)),
    (5, ("request",)),
    (6, ("api",)),
)
FRONT = 7  # every other top-level module and package: cli, cli_args, server, bench, ... and __init__
DIFFUSION = 4.5  # diffusion/: its own product, behind its own boundary (test_diffusion_stays_behind_its_boundary)


def layer(module: str) -> tuple[float, str]:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else None
    for number, names in LAYERS:
        if sub in names:
            return number, sub
    if sub == "diffusion":
        return DIFFUSION, "diffusion"
    return FRONT, f"front ({sub or PKG + '/__init__'})"


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


def upward(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if layer(e.dst)[0] > layer(e.src)[0]]


def test_imports_never_run_up_the_layers():
    bad = upward(EDGES)
    report = "\n".join(f"  {layer(e.src)[1]} -> {layer(e.dst)[1]}: {e}" for e in bad)
    print(report)
    assert not bad, f"{len(bad)} import(s) run up the layers (errors < models < core < proposers, constraints < " \
                    f"strategies < request < api < front ends):\n{report}"


def diffusion_crossings(edges: list[Edge]) -> list[Edge]:
    """Imports across diffusion's boundary: from diffusion to anything above constraints, or into
    diffusion from below request."""
    def inside(m: str) -> bool:
        return layer(m)[0] == DIFFUSION

    return [e for e in edges if inside(e.src) != inside(e.dst)
            and ((inside(e.src) and layer(e.dst)[0] > 3) or (inside(e.dst) and layer(e.src)[0] < 5))]


def test_diffusion_stays_behind_its_boundary():
    bad = diffusion_crossings(EDGES)
    assert not bad, "imports across diffusion's boundary:\n" + "\n".join(f"  {e}" for e in bad)


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


def test_a_planted_upward_import_is_caught(monkeypatch, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ..api import generate\n")
    monkeypatch.setitem(MODULES, f"{PKG}.core.generate", f)
    assert [e.dst for e in upward(edges_of(f"{PKG}.core.generate"))] == [f"{PKG}.api"]


@pytest.mark.parametrize("src, code, dst", [
    ("strategies.beam", "from ..request import validate_request", "request"),  # a strategy above the request
    ("constraints.grammar", "from ..strategies.search import TreeSearch", "strategies.search"),
    ("request", "from .api import start_request", "api"),
    ("api", "from .cli_args import decoding_request", "cli_args"),
    ("proposers.pld", "from ..constraints.grammar import compile_constraint", None),  # one layer: allowed
])
def test_the_full_order_is_enforced(monkeypatch, tmp_path, src, code, dst):
    f = tmp_path / "m.py"
    f.write_text(code + "\n")
    monkeypatch.setitem(MODULES, f"{PKG}.{src}", f)
    assert [e.dst for e in upward(edges_of(f"{PKG}.{src}"))] == ([f"{PKG}.{dst}"] if dst else [])


@pytest.mark.parametrize("src, code, crosses", [
    ("diffusion.stepwise", "from ..strategies.search import TreeSearch", True),
    ("diffusion.stepwise", "from ..bench.workloads import humaneval_path", True),
    ("diffusion.stepwise", "from ..constraints.grammar import compile_constraint", False),
    ("strategies.beam", "from ..diffusion.registry import DIFFUSION_METHODS", True),
    ("request", "from .diffusion.registry import DIFFUSION_METHODS", False),
])
def test_a_planted_crossing_of_diffusions_boundary_is_caught(monkeypatch, tmp_path, src, code, crosses):
    f = tmp_path / "m.py"
    f.write_text(code + "\n")
    monkeypatch.setitem(MODULES, f"{PKG}.{src}", f)
    assert bool(diffusion_crossings(edges_of(f"{PKG}.{src}"))) is crosses


# ------------------------------------------------------------- private attributes, dynamic imports
def module_aliases(tree: ast.AST, src: str) -> dict[str, str]:
    """Local names bound to modules of the package by this module's imports."""
    out = {}
    for node, _ in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    out[alias.asname] = alias.name
            continue
        target = _resolve_relative(src, node.level, node.module) if node.level else (node.module or "")
        for alias in node.names:
            if f"{target}.{alias.name}" in MODULES:
                out[alias.asname or alias.name] = f"{target}.{alias.name}"
    return out


def private_accesses(src: str) -> list[str]:
    """``mod._name`` where ``mod`` is another module of the package imported here."""
    tree = ast.parse(MODULES[src].read_text())
    aliases = module_aliases(tree, src)
    return [f"{src}:{n.lineno} {n.value.id}.{n.attr} ({aliases[n.value.id]})" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and aliases[n.value.id] != src and n.attr.startswith("_") and not n.attr.endswith("__")]


def test_no_private_attribute_of_another_module_is_read():
    bad = [a for m in MODULES for a in private_accesses(m)]
    assert not bad, "private names read across modules:\n" + "\n".join(bad)


def test_a_planted_private_access_is_caught(monkeypatch, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from ..core import runner\n\ndef f():\n    return runner._hidden\n")
    monkeypatch.setitem(MODULES, f"{PKG}.bench.suite", f)
    assert private_accesses(f"{PKG}.bench.suite") == [f"{PKG}.bench.suite:4 runner._hidden ({PKG}.core.runner)"]


# modules allowed to import by name at run time, and why (none of them imports the package)
DYNAMIC_IMPORTS_ALLOWED = {
    f"{PKG}.bench.workloads": "imports standard-library modules to read their docstrings (the `similar` workload)",
}


def dynamic_imports(src: str) -> list[int]:
    """Lines of ``importlib.import_module(...)`` and ``__import__(...)`` calls."""
    tree = ast.parse(MODULES[src].read_text())
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                out.append(n.lineno)
    return out


def test_no_module_imports_the_package_by_name():
    found = {m: lines for m in MODULES if (lines := dynamic_imports(m))}
    bad = {m: lines for m, lines in found.items() if m not in DYNAMIC_IMPORTS_ALLOWED}
    assert not bad, f"imports by name at run time (hidden from the layer and cycle checks): {bad}"
    assert set(found) == set(DYNAMIC_IMPORTS_ALLOWED), "an allowed module no longer imports by name: drop it"


def test_a_planted_dynamic_import_is_caught(monkeypatch, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import importlib\n\ndef f():\n    return importlib.import_module('leapdecode.cli')\n")
    monkeypatch.setitem(MODULES, f"{PKG}.api", f)
    assert dynamic_imports(f"{PKG}.api") == [4]


REMOVED = {  # a deprecated path, removed (issue 65) -> where its module moved (issue 48)
    "strategies.grammar": "constraints.grammar", "strategies.asap": "constraints.asap",
    "heads_data": "training.data", "heads_train": "training.train", "heads_eval": "training.accuracy",
    "heads_cli": "training.cli",
}


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_a_removed_alias_is_gone_and_the_release_notes_name_its_replacement(old):
    import importlib

    importlib.import_module(f"{PKG}.{REMOVED[old]}")  # the new home imports
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{PKG}.{old}")
    notes = (Path(__file__).resolve().parents[1] / "docs" / "releases.md").read_text()
    assert f"| `{PKG}.{old}` | `{PKG}.{REMOVED[old]}` |" in notes
