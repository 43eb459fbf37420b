"""The package's imports: they point down the data flow, form no circle, and an import
inside a function says why it waits.

``python -m ulysses_mm.tools.layers`` reports, as ``file:line: text``, and exits 1 on any:

- an import (module level or inside a function) of a higher layer than the importing
  module's own (the layers, lowest first, are :data:`LAYERS`);
- an import circle among the package's modules, counting imports at module level and
  inside functions alike (those under ``if TYPE_CHECKING:`` run never and are left out),
  so delaying an import into a function does not hide a circle: the shared piece moves
  down instead;
- an import inside a function without a trailing ``# lazy: <why>`` comment (on any
  line of the statement). Such an import is only for delaying an expensive one (torch,
  transformers, deepspeed, av, ray, ..., or a module of ours that pulls one of them into
  a lighter layer), and says so.

``make lint`` runs it. The torch-free layers (``core``, ``config``, ``tokenize``,
``shards``) are checked apart by importing them (tests/unit/test_offline_imports.py).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ulysses_mm"
LAZY = "# lazy:"

# Lowest first: a module may import its own layer and the ones before it.
LAYERS = (
    "core",
    "config",
    "tokenize",
    "shards",
    "loader",
    "model",
    "parallel",
    "train",
    "hf",
    "tools",
    "cli",
)
# Top-level modules that are not a layer folder, and the layer they sit in.
TOP = {"__init__": "core", "__main__": "cli", "cli": "cli"}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name inside the package (None outside it)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return "core"
    name = parts[1]
    return name if name in LAYERS else TOP.get(name, name)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@dataclass(frozen=True)
class Import:
    """One imported module of one import statement."""

    line: int
    target: str  # the dotted module (for ``from m import n``: m.n when that is a module)
    in_function: bool
    lazy: bool  # the statement carries a ``# lazy:`` comment


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import statement, inside a function) of every import that can run: those under
    ``if TYPE_CHECKING:`` are left out (their ``else:`` branch is not)."""

    def walk(
        node: ast.AST, in_function: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), in_function)
            else:
                inner = in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                )
                yield from walk(child, inner)

    yield from walk(tree, False)


def imports(
    tree: ast.AST,
    module: str,
    is_package: bool,
    lines: list[str] | None = None,
    modules: frozenset[str] = frozenset(),
) -> Iterator[Import]:
    """Every module imported in ``tree`` (relative imports resolved). ``from m import n``
    imports ``m.n`` when that is one of ``modules``, else ``m``; ``lines`` (the source)
    tell which statements carry a ``# lazy:`` comment."""
    for node, in_function in _statements(tree):
        end = node.end_lineno or node.lineno
        lazy = lines is not None and any(LAZY in s for s in lines[node.lineno - 1 : end])
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, in_function, lazy)
            continue
        base = node.module or ""
        if node.level:
            here = module.split(".")
            up = here if is_package else here[:-1]
            up = up[: len(up) - (node.level - 1)]
            base = ".".join([*up, base] if base else up)
        names = [f"{base}.{a.name}" for a in node.names]
        if base == PACKAGE:  # from ulysses_mm import config: each name is a module
            for name in names:
                yield Import(node.lineno, name, in_function, lazy)
            continue
        submodules = [n for n in names if n in modules]
        if len(submodules) < len(names) or not submodules:
            yield Import(node.lineno, base, in_function, lazy)
        for name in submodules:
            yield Import(node.lineno, name, in_function, lazy)


@dataclass
class Source:
    path: Path
    module: str
    tree: ast.AST
    lines: list[str]


def _sources(root: Path) -> list[Source]:
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        out.append(
            Source(path, module_name(path, root), ast.parse(text, str(path)), text.splitlines())
        )
    return out


def _imports_of(src: Source, modules: frozenset[str]) -> list[Import]:
    return list(imports(src.tree, src.module, src.path.name == "__init__.py", src.lines, modules))


def violations(root: Path) -> list[str]:
    """Every upward import under the package directory ``root``, as ``file:line: text``."""
    order = {name: i for i, name in enumerate(LAYERS)}
    sources = _sources(root)
    modules = frozenset(s.module for s in sources)
    out = []
    for src in sources:
        mine = layer_of(src.module)
        if mine not in order:
            out.append(f"{src.path}:1: {src.module} is in no layer (known: {', '.join(LAYERS)})")
            continue
        for imp in _imports_of(src, modules):
            theirs = layer_of(imp.target)
            if theirs is None:
                continue
            if theirs not in order:
                out.append(
                    f"{src.path}:{imp.line}: {src.module} imports {imp.target}, which is in no layer"
                )
            elif order[theirs] > order[mine]:  # type: ignore[index]
                out.append(
                    f"{src.path}:{imp.line}: {src.module} ({mine}) imports {imp.target} "
                    f"({theirs}), a later layer of the flow"
                )
    return out


def unmarked_lazy_imports(root: Path) -> list[str]:
    """Every import inside a function under ``root`` without a ``# lazy: <why>`` comment."""
    out = []
    for src in _sources(root):
        seen = set()
        for imp in _imports_of(src, frozenset()):
            if imp.in_function and not imp.lazy and imp.line not in seen:
                seen.add(imp.line)
                out.append(
                    f"{src.path}:{imp.line}: an import inside a function without a "
                    f"'{LAZY} <why>' comment: move it to the top, or say what it delays"
                )
    return out


def cycles(root: Path) -> list[str]:
    """Every import circle among the modules under ``root``: one line per circle (a
    strongly connected component of modules), naming a shortest loop through it with the
    file and line of each of its imports."""
    sources = _sources(root)
    modules = frozenset(s.module for s in sources)
    by_module = {s.module: s for s in sources}
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for src in sources:
        for imp in _imports_of(src, modules):
            if imp.target in modules and imp.target != src.module:
                edges[src.module].setdefault(imp.target, imp.line)
    out = []
    for component in _strongly_connected(edges):
        if len(component) < 2:
            continue
        start = min(component)
        loop = _shortest_loop(start, edges, component)
        steps = [
            f"{by_module[a].path.relative_to(root.parent)}:{edges[a][b]} -> {b}"
            for a, b in itertools.pairwise(loop)
        ]
        first = by_module[start]
        out.append(
            f"{first.path}:{edges[start][loop[1]]}: import circle of {len(component)} modules "
            f"({', '.join(sorted(component))}): " + "; ".join(steps)
        )
    return out


def _strongly_connected(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                components.append(component)
    return components


def _shortest_loop(start: str, edges: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """start -> ... -> start, fewest imports, inside ``component`` (breadth first)."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges[node]):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if child not in came:
                    came[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start, start]  # unreachable for a component of two or more


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ulysses_mm.tools.layers",
        description=(
            "Fail on an import that points up the flow ("
            + " < ".join(LAYERS)
            + "), on an import circle and on an import inside a function without a "
            f"'{LAZY} <why>' comment."
        ),
    )
    parser.add_argument(
        "root",
        nargs="?",
        default=str(Path(__file__).resolve().parents[1]),
        help="the package directory (default: this package)",
    )
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    checks = {
        "upward import(s)": violations(root),
        "import circle(s)": cycles(root),
        "unmarked import(s) inside a function": unmarked_lazy_imports(root),
    }
    for found in checks.values():
        for line in found:
            print(line)
    counts = [f"{len(found)} {what}" for what, found in checks.items() if found]
    if counts:
        print(", ".join(counts), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
