"""The package's layers follow the data flow; an import may only point down it.

``python -m ulysses_mm.tools.layers`` lists every import (module level or inside a
function) of a higher layer than the importing module's own, and exits 1 if there is one.
``make lint`` runs it. The torch-free layers (``core``, ``config``, ``tokenize``,
``shards``) are checked apart by importing them (tests/unit/test_offline_imports.py).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "ulysses_mm"

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


def imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in ``tree``, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")
                up = here if is_package else here[:-1]
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if base == PACKAGE:  # from ulysses_mm import config: each name is a module
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
            else:
                yield node.lineno, base


def violations(root: Path) -> list[str]:
    """Every upward import under the package directory ``root``, as ``file:line: text``."""
    order = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        mine = layer_of(module)
        if mine not in order:
            out.append(f"{path}:1: {module} is in no layer (known: {', '.join(LAYERS)})")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, target in imports(tree, module, path.name == "__init__.py"):
            theirs = layer_of(target)
            if theirs is None:
                continue
            if theirs not in order:
                out.append(f"{path}:{line}: {module} imports {target}, which is in no layer")
            elif order[theirs] > order[mine]:  # type: ignore[index]
                out.append(
                    f"{path}:{line}: {module} ({mine}) imports {target} ({theirs}), "
                    f"a later layer of the flow"
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ulysses_mm.tools.layers",
        description="Fail on an import that points up the flow: " + " < ".join(LAYERS) + ".",
    )
    parser.add_argument(
        "root",
        nargs="?",
        default=str(Path(__file__).resolve().parents[1]),
        help="the package directory (default: this package)",
    )
    args = parser.parse_args(argv)
    found = violations(Path(args.root).resolve())
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} upward import(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
