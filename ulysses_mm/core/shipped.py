"""Shipped pipelines, run configs and tokenizer specs by name: ``ulysses-mm prepare dna``,
``ulysses-mm train debug-stages``, ``ulysses-mm tokenizer eval video-h264 clip.mp4``.

A bare NAME (no ``/``, no ``.yaml`` / ``.yml``, no file of that name here) means the
shipped ``pipelines/NAME.yaml`` or ``configs/NAME.yaml`` (a spec: ``tokenizers/NAME.json``,
named NAME or NAME.json) — in an installed wheel or the clone
(:func:`ulysses_mm.core.resources.resource`). A path that exists always wins, and anything
else is a path the caller checks as usual. Torch-free: the CLI imports it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from ulysses_mm.core.checks import CheckError, in_file, is_remote
from ulysses_mm.core.resources import resource, shipped_tokenizer, shipped_tokenizer_names

# The folders that hold files by name, and what one of their files is called.
FOLDERS = {"pipelines": "pipeline", "configs": "run config"}
SUFFIX = ".yaml"
# A description is one sentence; past this many characters it is shortened.
DESCRIPTION_WIDTH = 90


def names(folder: str) -> list[str]:
    """The names shipped in ``folder`` (``dna`` for pipelines/dna.yaml), sorted."""
    return sorted(p.stem for p in resource(folder).glob(f"*{SUFFIX}"))


def is_name(value: str) -> bool:
    """``value`` is written as a name, not a path: no separator, no YAML suffix, no URL."""
    return bool(value) and not (
        "/" in value or "\\" in value or value.endswith((".yaml", ".yml")) or is_remote(value)
    )


def named(folder: str, value: str | Path) -> Path | None:
    """The shipped file a bare name means, or None: ``value`` is written as a path, names a
    local file, or names nothing shipped."""
    text = str(value)
    if not is_name(text) or Path(text).exists():
        return None
    path = resource(folder) / f"{text}{SUFFIX}"
    return path if path.is_file() else None


def find(folder: str, value: str | Path, name: str = "") -> Path:
    """The file ``value`` means: itself when it exists or is written as a path, else the
    shipped ``folder/value.yaml``. A name nothing ships is one line listing what does."""
    text = str(value)
    path = named(folder, text)
    if path is not None:
        return path
    if is_name(text) and not Path(text).exists():
        said = f"{name} " if name else ""
        raise CheckError(
            f"{said}{text}: no such file, nor a shipped {FOLDERS[folder]} of that name "
            f"(shipped: {', '.join(names(folder))}; `ulysses-mm {folder}` describes them)"
        )
    return Path(text)


def run_config(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input run config: a file, or a shipped one's name (``debug-stages``), returned as
    the path of the file it means."""
    return in_file(str(find("configs", value, name)), name, exist=exist)


def pipeline(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input pipeline: a file, or a shipped one's name (``dna``), returned as given: a
    named pipeline writes under the working directory, which
    :func:`~ulysses_mm.shards.prepare.run.load_pipeline_config` sees from the name."""
    in_file(str(find("pipelines", value, name)), name, exist=exist)
    return value


def tokenizer_spec(value: str, name: str = "", *, exist: bool = True) -> str:
    """An input tokenizer spec: a file, or a shipped spec's name (``video-h264`` or
    ``video-h264.json``), returned as the path of the file it means."""
    path = None if Path(value).exists() else shipped_tokenizer(value)
    if path is not None:
        return str(path)
    if value and "/" not in value and "\\" not in value and not Path(value).exists():
        said = f"{name} " if name else ""
        raise CheckError(
            f"{said}{value}: no such file, nor a shipped tokenizer spec of that name "
            f"(shipped: {', '.join(shipped_tokenizer_names())})"
        )
    return in_file(value, name, exist=exist)


# Path kinds beside :data:`ulysses_mm.core.checks.PATHS`, with the same signature.
PATHS: dict[str, Callable[..., str]] = {
    "run_config": run_config,
    "pipeline": pipeline,
    "tokenizer_spec": tokenizer_spec,
}


def description(path: Path) -> str:
    """The first sentence of a file's leading comment, shortened to one line (before its
    first ``": "`` when that leaves a clause, else at a word)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(x for x in lines if x)
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    if len(sentence) > DESCRIPTION_WIDTH:
        head = sentence.split(": ", 1)[0]
        if 30 <= len(head) < len(sentence):
            sentence = head
    return textwrap.shorten(sentence, DESCRIPTION_WIDTH, placeholder=" …", break_on_hyphens=False)


def describe(folder: str) -> list[tuple[str, str]]:
    """(name, one-line description) of every file shipped in ``folder``."""
    return [(name, description(resource(folder) / f"{name}{SUFFIX}")) for name in names(folder)]


# folder -> the command that runs one of its files by name
RUNS = {"pipelines": "prepare", "configs": "train"}


def listing(folder: str, name: str | None = None) -> str:
    """What ``ulysses-mm pipelines|configs [NAME]`` prints: one file's text, or every
    shipped name with its description and where they live."""
    if name is not None:
        return resource(folder).joinpath(f"{name}{SUFFIX}").read_text(encoding="utf-8")
    rows = describe(folder)
    width = max(len(n) for n, _ in rows)
    lines = [f"{n:<{width}}  {text}" for n, text in rows]
    lines.append(
        f"(in {resource(folder)}; `ulysses-mm {folder} NAME` prints one, "
        f"`ulysses-mm {RUNS[folder]} NAME` runs it)"
    )
    return "\n".join(lines) + "\n"


def shipped_name(folder: str, value: str) -> str:
    """``value`` when ``folder`` ships it, else one line listing what it ships."""
    if value not in names(folder):
        raise CheckError(
            f"no shipped {FOLDERS[folder]} {value!r} (shipped: {', '.join(names(folder))})"
        )
    return value
