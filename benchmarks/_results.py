"""Where a benchmark's figures go: one dated JSON file per run, beside the ``key=value``
line it prints last.

``record("bench_pack", {"pack_mtok_s": 41.2, ...})`` writes
``benchmarks/results/<bench>_<hardware>_<date>.json`` (hardware ``cpu-<N>core`` or the GPU's
name, date in UTC; a later run the same day replaces it) with the command line and the
figures, and says where on stderr, so stdout still ends in the ``key=value`` line.
``ULYSSES_MM_BENCH_RESULTS=DIR`` writes to DIR instead (the smoke tests use a temporary
one); a ``--smoke`` run without it writes to ``benchmarks/results/smoke/``, never beside
real figures.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ENV = "ULYSSES_MM_BENCH_RESULTS"


def hardware(gpu: bool | None = None) -> str:
    """``cpu-<N>core``, or the first CUDA device's name (``nvidia-h200``, ``2x-nvidia-h200``)
    when ``gpu`` (default: when torch is imported and sees one)."""
    torch = sys.modules.get("torch")
    if gpu is None:
        gpu = torch is not None and torch.cuda.is_available()
    if gpu:
        import torch

        name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
        count = torch.cuda.device_count()
        return f"{count}x-{name}" if count > 1 else name
    return f"cpu-{os.cpu_count() or 1}core"


def results_dir(smoke: bool = False) -> Path:
    env = os.environ.get(ENV)
    if env:
        return Path(env)
    return RESULTS / "smoke" if smoke else RESULTS


def _plain(value: Any) -> Any:
    """JSON for numpy scalars, paths and tuples as well."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def record(
    bench: str,
    figures: dict[str, Any],
    *,
    smoke: bool = False,
    gpu: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``figures`` (and ``extra``: tables, settings) as this run's result file;
    returns its path. ``bench`` is the script's name without ``.py``."""
    hw = hardware(gpu)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    out = results_dir(smoke)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bench}_{hw}_{date}.json"
    doc = {
        "bench": bench,
        "hardware": hw,
        "date": date,
        "command": " ".join(["python", f"benchmarks/{bench}.py", *sys.argv[1:]]),
        "smoke": smoke,
        "figures": _plain(figures),
        **_plain(extra or {}),
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"figures: {path}", file=sys.stderr)
    return path


def key_values(line: str) -> dict[str, Any]:
    """The figures of a ``key=value key=value`` line (numbers as numbers)."""
    out: dict[str, Any] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if not sep:
            continue
        try:
            out[key] = float(value) if any(c in value for c in ".eEn") else int(value)
        except ValueError:
            out[key] = {"true": True, "false": False}.get(value, value)
    return out
