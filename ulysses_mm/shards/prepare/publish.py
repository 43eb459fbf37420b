"""Where ``prepare`` puts a dataset: shards and ``manifest.json`` in a directory or URL.

Shards are written where they can be published atomically: in the output directory itself
(then renamed into place) or, for a URL, in a local upload area (uploaded, then moved).
A previous dataset's manifest is removed just before its first shard is replaced, so a
manifest never describes shards it does not match. Each partition has its own
:class:`Output` (its own folder when the dataset has several), so partitions written at
the same time on different machines never touch each other's files.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

from ulysses_mm.core import storage
from ulysses_mm.shards.manifest import MANIFEST_NAME
from ulysses_mm.shards.writer import ShardRecord

_SHARD_RE = re.compile(r"^shard-\d{6}\.tar$")
_PART_RE = re.compile(r"^part-\d{5}$")


def part_prefix(index: int, multi: bool) -> str:
    """Where partition ``index``'s shards go, relative to the output ('' for one partition)."""
    return f"part-{index:05d}/" if multi else ""


class Output:
    """Partition ``index``'s destination in a dataset at ``url`` (a directory or a URL)."""

    def __init__(self, url: storage.Location, staging: str, index: int, multi: bool) -> None:
        self.url = url
        self.local = url.is_local
        self.prefix = part_prefix(index, multi)  # of its shards' names, relative to url
        sub = self.prefix.rstrip("/")
        self.dir_url = url.join(sub) if sub else url
        self.dir_url.makedirs()
        if self.local:
            self.write_dir = self.dir_url.local_path
        else:
            self.write_dir = Path(staging) / "upload" / (sub or "part")
        self.write_dir.mkdir(parents=True, exist_ok=True)
        self.dir_url.remove_stale_temps()
        if not self.local:
            for p in self.write_dir.iterdir():
                p.unlink()
        self.claimed = False
        self.manifest_url = url.join(MANIFEST_NAME)

    def publish(self, tmp: Path, record: ShardRecord) -> None:
        if not self.claimed:  # the old manifest must go before its first shard changes
            self.manifest_url.remove()
            self.claimed = True
        self.url.join(record.name).publish(tmp)


def remove_stale_shards(url: storage.Location, keep: Collection[str]) -> None:
    """Remove the shards under ``url`` (``shard-N.tar`` and ``part-P/shard-N.tar``) that
    are not in ``keep`` (names relative to ``url``), and partition folders left empty."""
    for name in url.list_names():
        if _SHARD_RE.match(name) and name not in keep:
            url.join(name).remove()
    for sub in url.list_dirs():
        if not _PART_RE.match(sub):
            continue
        where = url.join(sub)
        for name in where.list_names():
            if _SHARD_RE.match(name) and f"{sub}/{name}" not in keep:
                where.join(name).remove()
        where.remove_empty_dir()
