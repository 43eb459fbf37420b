"""The YAML the docs show of a shipped file is that file's text.

The convention (README.md and every page of docs/): a ``yaml`` code block that shows a
shipped pipeline or run config names it on its first line, ``# configs/NAME.yaml`` or
``# pipelines/NAME.yaml`` (more words may follow the path). The rest of the block is an
excerpt: a run of the file's lines exactly as written, or several runs in the file's order,
each gap marked by a line ``# …``. A block that names a file nothing ships (a pipeline
the reader writes) is not checked. A YAML block that does not name its file while the
paragraph next to it names a shipped one fails too, so an excerpt cannot go unchecked by
leaving its name out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)")
NAMED = re.compile(r"^#\s+((?:configs|pipelines)/[\w.-]+\.ya?ml)\b")
GAP = "# …"
SHIPPED_PATH = re.compile(r"`((?:configs|pipelines)/[\w.-]+\.ya?ml)`")


def blocks(page: Path) -> list[tuple[int, str, list[str], str, str]]:
    """(line number, language, lines, paragraph before, paragraph after) of every fenced
    block, its lines without the fence's indentation."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]
        ]
        out.append((i + 1, lang, body, _paragraph(lines, i, -1), _paragraph(lines, j, +1)))
        i = j + 1
    return out


def _paragraph(lines: list[str], at: int, step: int) -> str:
    """The paragraph next to line ``at`` going ``step`` (blank lines skipped), up to the
    next blank line or fence."""
    out = []
    k = at + step
    while 0 <= k < len(lines) and not lines[k].strip():
        k += step
    while 0 <= k < len(lines) and lines[k].strip() and not FENCE.match(lines[k]):
        out.append(lines[k])
        k += step
    return " ".join(out)


def runs(body: list[str]) -> list[list[str]]:
    """The block's runs of lines, split at the ``# …`` gap lines."""
    out: list[list[str]] = [[]]
    for line in body:
        if line.strip() == GAP:
            out.append([])
        else:
            out[-1].append(line)
    return [r for r in out if r]


def excerpt_of(body: list[str], text: list[str]) -> str | None:
    """None when every run of ``body`` is a run of ``text``'s lines, in order; else the
    first line that is not where it should be."""
    start = 0
    for run in runs(body):
        found = next(
            (k for k in range(start, len(text) - len(run) + 1) if text[k : k + len(run)] == run),
            None,
        )
        if found is None:
            return next((x for x in run if x not in text[start:]), run[0])
        start = found + len(run)
    return None


def _yaml_blocks():
    for page in PAGES:
        for line, lang, body, before, after in blocks(page):
            if lang in ("yaml", "yml"):
                yield pytest.param(page, body, before, after, id=f"{page.name}:{line}")


@pytest.mark.parametrize(("page", "body", "before", "after"), list(_yaml_blocks()))
def test_a_yaml_block_that_shows_a_shipped_file_is_its_text(page, body, before, after):
    named = NAMED.match(body[0]) if body else None
    if named is None:
        nearby = [p for p in SHIPPED_PATH.findall(f"{before} {after}") if (REPO / p).is_file()]
        assert not nearby, (
            f"{page.name}: a YAML block next to a paragraph naming {nearby[0]} does not name "
            f"its file; start it with '# {nearby[0]}' so it is checked against the file"
        )
        return
    path = REPO / named.group(1)
    if not path.is_file():  # a file the reader writes, not one that ships
        return
    wrong = excerpt_of(body[1:], path.read_text(encoding="utf-8").splitlines())
    assert wrong is None, (
        f"{page.name}: the excerpt of {named.group(1)} differs from it at {wrong!r}"
    )


def test_the_convention_is_in_use():
    """At least the excerpt the docs had wrong is checked now."""
    named = [
        NAMED.match(body[0]).group(1)
        for page in PAGES
        for _, lang, body, _, _ in blocks(page)
        if lang in ("yaml", "yml") and body and NAMED.match(body[0])
    ]
    assert "configs/debug-stages.yaml" in named


def test_an_excerpt_is_checked_run_by_run():
    text = ["a: 1", "b:", "  c: 2", "d: 3", "e: 4"]
    assert excerpt_of(["b:", "  c: 2"], text) is None
    assert excerpt_of(["a: 1", GAP, "d: 3", "e: 4"], text) is None
    assert excerpt_of(["b:", "  c: 3"], text) == "  c: 3"
    assert excerpt_of(["d: 3", GAP, "a: 1"], text) == "a: 1"  # out of order
    assert excerpt_of(["a: 1", "d: 3"], text) is not None  # a gap not marked
