"""mkdocs hook: the tables of figures in the docs are rendered from result files.

A page writes, on a line of its own, ``<!-- results: BENCH -->``, ``<!-- results: BENCH/TABLE -->`` or
``<!-- results: BENCH HARDWARE -->``, and the build replaces the marker with a Markdown
table made from the newest ``benchmarks/results/BENCH_HARDWARE_DATE.json`` (HARDWARE
without underscores, DATE as YYYY-MM-DD; newest = latest date, then latest written; smoke
runs are never used). ``/TABLE`` takes the newest file that holds that named table.
``<!-- results-index -->`` lists the newest file of every bench and hardware.

A file may hold ``table`` (``columns`` + ``rows``) and named ``tables`` (as the files
moved out of prose do), or ``figures`` (as ``benchmarks/_results.py`` writes them: flat
figures become a figure/value table, figures that are all mappings a row each), or
``rows`` (a list of mappings). A marker whose file or table is missing fails the build, so
a page never silently loses its figures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(
    r"(?m)^([ \t]*)<!--\s*results:\s*([\w.\-]+)(?:/([\w.\-]+))?(?:\s+([\w.\-]+))?\s*-->"
)
INDEX = re.compile(r"(?m)^([ \t]*)<!--\s*results-index\s*-->")
NAME = re.compile(r"^(.+)_([^_]+)_(\d{4}-\d{2}-\d{2})\.json$")


def _results_dir(config: Any) -> Path:
    return Path(config.config_file_path).resolve().parent / "benchmarks" / "results"


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise PluginError(f"results: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise PluginError(f"results: {path} is not a JSON object")
    return data


def candidates(folder: Path) -> list[tuple[str, str, str, float, Path]]:
    """(bench, hardware, date, mtime, path) of every result file that is not a smoke run."""
    out = []
    for p in folder.glob("*.json"):
        m = NAME.match(p.name)
        if m and not _load(p).get("smoke"):
            out.append((m.group(1), m.group(2), m.group(3), p.stat().st_mtime, p))
    return out


def newest(folder: Path, bench: str, hardware: str | None, table: str | None) -> Path:
    """The newest file of ``bench`` (of ``hardware``; holding ``table``)."""
    found = [
        (date, mtime, p)
        for b, hw, date, mtime, p in candidates(folder)
        if b == bench
        and (hardware is None or hw == hardware)
        and (table is None or table in (_load(p).get("tables") or {}))
    ]
    if not found:
        what = f"{bench}_{hardware or 'HARDWARE'}_DATE.json" + (
            f" with table {table!r}" if table else ""
        )
        raise PluginError(f"results: no {what} in {folder}")
    return max(found)[2]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        text = f"{v:,.6g}" if abs(v) >= 1000 else f"{v:g}"
    elif isinstance(v, int) and not isinstance(v, bool):
        text = f"{v:,}"
    elif isinstance(v, (dict, list)):
        text = "`" + json.dumps(v, separators=(", ", ": ")) + "`"
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _from_mappings(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    columns = list(dict.fromkeys(k for r in rows.values() for k in r))
    return {
        "columns": ["case", *columns],
        "rows": [[k, *(r.get(c, "") for c in columns)] for k, r in rows.items()],
    }


def table_of(data: dict[str, Any], name: str | None, where: Path) -> tuple[dict[str, Any], str]:
    """The table to render and its notes."""
    if name is not None:
        tables = data.get("tables") or {}
        if name not in tables:
            raise PluginError(f"results: {where.name} has no table {name!r} (has {sorted(tables)})")
        return tables[name], tables[name].get("notes", "")
    notes = data.get("notes", "")
    if "table" in data:
        return data["table"], notes
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        return _from_mappings({str(i + 1): r for i, r in enumerate(rows)}), notes
    figures = data.get("figures")
    if isinstance(figures, dict) and figures:
        if all(isinstance(v, dict) for v in figures.values()):
            return _from_mappings(figures), notes
        return {"columns": ["figure", "value"], "rows": [[k, v] for k, v in figures.items()]}, notes
    raise PluginError(f"results: {where.name} holds no table, rows or figures")


def render(path: Path, name: str | None) -> str:
    data = _load(path)
    t, notes = table_of(data, name, path)
    columns, rows = t.get("columns"), t.get("rows")
    if not columns or not isinstance(rows, list) or any(len(r) != len(columns) for r in rows):
        raise PluginError(f"results: {path.name} {name or 'table'}: rows do not match columns")
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    caption = [f"`benchmarks/results/{path.name}`"]
    if data.get("command"):
        caption.append(f"`{data['command']}`")
    caption += [str(data[k]) for k in ("hardware", "date") if data.get(k)]
    text = "\n".join(lines) + "\n\n<small>" + " · ".join(caption)
    if notes:
        text += " — " + notes
    return "\n" + text + "</small>\n"


def render_index(folder: Path) -> str:
    latest: dict[tuple[str, str], tuple[str, float, Path]] = {}
    for bench, hw, date, mtime, p in candidates(folder):
        latest[(bench, hw)] = max(latest.get((bench, hw), (date, mtime, p)), (date, mtime, p))
    if not latest:
        raise PluginError(f"results: no result files in {folder}")
    lines = ["| bench | hardware | date | file |", "|---|---|---|---|"]
    for (bench, hw), (date, _, p) in sorted(latest.items()):
        lines.append(f"| {bench} | {hw} | {date} | `benchmarks/results/{p.name}` |")
    return "\n" + "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    folder = _results_dir(config)
    markdown = INDEX.sub(lambda m: _indent(render_index(folder), m.group(1)), markdown)
    return MARKER.sub(
        lambda m: _indent(
            render(newest(folder, m.group(2), m.group(4), m.group(3)), m.group(3)), m.group(1)
        ),
        markdown,
    )


def _indent(text: str, prefix: str) -> str:
    """The table at the marker's indentation, so a marker inside a list item stays in it."""
    return "\n".join(prefix + line if line else line for line in text.split("\n"))
