"""The files the package ships beside its code: tokenizer specs and their artifacts,
pipelines, run configs and the demo's sample files (with their ATTRIBUTION.md).

In a clone they live at the top of the repository (``tokenizers/``, ``pipelines/``,
``configs/``, ``tests/data/``); a wheel carries a copy of the same tree under
``ulysses_mm/_data/`` (``setup.py`` copies it at build time), so relative paths inside a
pipeline file (``../tokenizers/dna-base.json``, ``../tests/data/*.fa``) hold in both.
:func:`resource` is the one lookup: the installed copy first, else the clone. Stdlib only:
``setup.py`` loads this file to learn what to ship.
"""

from __future__ import annotations

from pathlib import Path

# What ships, as paths relative to the repository root (and to ``ulysses_mm/_data/``).
SHIPPED = ("tokenizers", "pipelines", "configs", "tests/data")
# Never shipped: ``tokenizers/`` must hold no Python (a package named ``tokenizers`` would
# shadow Hugging Face's), nor caches and placeholders.
EXCLUDED_NAMES = ("__init__.py", "__pycache__", ".keep", ".DS_Store")

_PACKAGE = Path(__file__).resolve().parents[1]
INSTALLED = _PACKAGE / "_data"
CLONE = _PACKAGE.parent


def shipped_root() -> Path:
    """The directory holding ``tokenizers/``, ``pipelines/``, ``configs/`` and
    ``tests/data/``: the wheel's ``ulysses_mm/_data`` or the clone's root."""
    if (INSTALLED / "pipelines").is_dir():
        return INSTALLED
    return CLONE


def resource(relative: str) -> Path:
    """The shipped file or folder at ``relative`` (e.g. ``"pipelines/mixed.yaml"``), in the
    installed package or the clone; the path is returned whether or not it exists, so a
    caller can say what is missing."""
    return shipped_root() / relative


def shipped_files(root: Path) -> list[Path]:
    """Every file under ``root``'s shipped folders, as relative paths (what a wheel
    carries)."""
    out = []
    for top in SHIPPED:
        base = root / top
        for path in sorted(base.rglob("*")) if base.is_dir() else []:
            rel = path.relative_to(root)
            if path.is_file() and not set(rel.parts) & set(EXCLUDED_NAMES):
                out.append(rel)
    return out


def shipped_tokenizer_names() -> list[str]:
    """The names of the shipped tokenizer specs (``dna-base`` for tokenizers/dna-base.json)."""
    return sorted(p.stem for p in resource("tokenizers").glob("*.json"))


def shipped_tokenizer(name: str) -> Path | None:
    """The shipped spec a bare NAME or NAME.json means (``dna-base``, ``dna-base.json``),
    or None when ``name`` is a path or no spec of that name ships."""
    if not name or "/" in name or "\\" in name:
        return None
    stem = name[: -len(".json")] if name.endswith(".json") else name
    path = resource("tokenizers") / f"{stem}.json"
    return path if path.is_file() else None
