"""The loader inside a real run: two manifests mixed 0.7 / 0.3 through a node cache with
prefetch, two ranks (sp=2) sharing the cache; each source's share is logged and the cache
holds what was read, by content. Resumed with another layout (sp=2 → dp=2, the same
global batch), the run continues the same global sample order: its losses are those of
the uninterrupted run."""

from __future__ import annotations

import pytest
import yaml
from train_data import prepare_dna, train_rows

from ulysses_mm.shards.manifest import Manifest


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

    def train(out_dir, *overrides: str) -> dict[int, dict]:
        return train_rows(path, out_dir, *overrides, nproc=2)

    rows = train(run)
    last = rows[10]
    assert abs(last["mix/a"] - 0.7) <= 0.02 * 0.7 + 1 / 20  # 20 samples: ±1 sample
    assert abs(last["mix/a"] + last["mix/b"] - 1.0) < 1e-9
    shards = {s.sha256 for m in (a, b) for s in Manifest.load(str(m)).shards}
    cached = {p.stem for p in cache.glob("*.tar")}
    assert cached and cached <= shards  # what the run read, once, by content

    elastic = tmp_path / "elastic"
    train(elastic, "train.steps=6", "train.checkpoint_every=3")  # dp 1 × sp 2, mb 2
    resumed = train(
        elastic, "parallel.sp=1", "data.micro_batch_size=1", "--resume"
    )  # dp 2 × sp 1, mb 1: the same global batch of 2
    for step in range(7, 11):
        assert resumed[step]["loss"] == pytest.approx(rows[step]["loss"], rel=1e-5), step
        assert resumed[step]["mix/a"] == rows[step]["mix/a"]
