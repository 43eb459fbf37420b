"""The loader inside a real run: two manifests mixed 0.7 / 0.3 through a node cache with
prefetch, two ranks (sp=2) sharing the cache; each source's share is logged and every
shard was downloaded into the cache once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from conftest import REPO
from train_data import prepare_dna

from ulysses_mm.data.manifest import Manifest


def test_a_mixed_run_through_the_node_cache(tmp_path):
    a = prepare_dna(tmp_path, "a", records=24, seq_len=256, seed=1)
    b = prepare_dna(tmp_path, "b", records=12, seq_len=256, seed=2)
    run, cache = tmp_path / "run", tmp_path / "node-cache"
    cfg = {
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "loss_tile_tokens": 128,
        },
        "parallel": {"sp": 2, "timeout_s": 120},
        "data": {
            "train": {str(a): 0.7, str(b): 0.3},
            "micro_batch_size": 2,
            "cache_dir": str(cache),
            "cache_bytes": 1 << 26,
            "prefetch_bytes": 1 << 20,
        },
        "train": {"steps": 10, "checkpoint_every": 10, "out_dir": str(run)},
        "logging": {"wandb": "disabled"},
    }
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "ulysses_mm", "train", str(path), "--nproc", "2"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 10
    assert abs(last["mix/a"] - 0.7) <= 0.02 * 0.7 + 1 / 20  # 20 samples: ±1 sample
    assert abs(last["mix/a"] + last["mix/b"] - 1.0) < 1e-9
    shards = {s.sha256 for m in (a, b) for s in Manifest.load(str(m)).shards}
    cached = {p.stem for p in cache.glob("*.tar")}
    assert cached and cached <= shards  # what the run read, once, by content
