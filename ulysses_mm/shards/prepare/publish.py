"""Where ``prepare`` puts a dataset: shards and ``manifest.json`` in a directory or URL.

Shards are written where they can be published atomically: in the output directory itself
(then renamed into place) or, for a URL, in a local upload area (uploaded, then moved).
A previous dataset's manifest is removed just before its first shard is replaced, so a
manifest never describes shards it does not match.
"""

from __future__ import annotations

import re
from pathlib import Path

from ulysses_mm.config import PipelineConfig
from ulysses_mm.core import storage
from ulysses_mm.shards.manifest import MANIFEST_NAME
from ulysses_mm.shards.writer import ShardRecord

_SHARD_RE = re.compile(r"^shard-(\d{6})\.tar$")


class Output:
    """A dataset's destination (a local directory or a URL)."""

    def __init__(self, cfg: PipelineConfig, staging: Path) -> None:
        self.url = cfg.output
        self.so = dict(cfg.storage_options)
        self.local = storage.is_local(cfg.output)
        storage.makedirs(self.url, self.so)
        self.write_dir = storage.local_path(self.url) if self.local else staging / "upload"
        self.write_dir.mkdir(parents=True, exist_ok=True)
        storage.remove_stale_temps(self.url, self.so)
        if not self.local:
            for p in self.write_dir.iterdir():
                p.unlink()
        self.claimed = False
        self.manifest_url = storage.join(self.url, MANIFEST_NAME)

    def publish(self, tmp: Path, record: ShardRecord) -> None:
        if not self.claimed:  # the old manifest must go before its first shard changes
            storage.remove(self.manifest_url, self.so)
            self.claimed = True
        storage.publish_file(tmp, storage.join(self.url, record.name), self.so)

    def remove_stale_shards(self, keep: int) -> None:
        for name in storage.list_names(self.url, self.so):
            m = _SHARD_RE.match(name)
            if m and int(m.group(1)) >= keep:
                storage.remove(storage.join(self.url, name), self.so)
