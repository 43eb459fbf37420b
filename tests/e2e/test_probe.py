"""The long-context probe: a tiny model trained at SP=2 learns to copy across the rank
boundary.

Each document is 64 random bases, the same 64 again and an N, exactly one 132-token
sample, so at SP=2 rank 0 holds ``<doc> <|dna|>`` and the first half and rank 1 the
copy: every base of the second half is predicted from keys on the other rank. On held-out
documents (other random bases) the second half must fall below 0.1 bits per base while
the first stays at 2 (nothing predicts a random base). ``probe score --length`` scores the
same model on windows of one document cut out of longer samples, at lengths it was not
trained at, under another layout."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from train_data import train_rows

from ulysses_mm.cli import main
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tools.probe import halves, write_probe
from ulysses_mm.train.metrics import LN2

L = 64


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("probe")
    data = write_probe(tmp_path / "probe", L, documents=1600, eval_documents=64, seed=0)
    m = Manifest.load(str(data.eval))
    assert m.seq_len == 2 * L + 4 == data.seq_len
    sample = read_samples((data.eval.parent / m.shards[0].url).read_bytes(), "eval")[0]
    first, second = sample.tokens[2 : L + 2], sample.tokens[L + 2 : 2 * L + 2]
    assert (first == second).all() and len(sample.segments) == 1  # one document, the copy
    # at SP=2 each rank holds half the sample: the copy is all on rank 1, its source on 0
    assert data.seq_len // 2 == L + 2

    config = tmp_path / "probe.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "hidden_size": 64,
                    "intermediate_size": 172,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                },
                "parallel": {"sp": 2},
                "data": {"train": str(data.train), "micro_batch_size": 8},
                "train": {"steps": 200, "log_every": 50, "seed": 0},
                "deepspeed": {
                    "optimizer": {"lr": 0.003, "weight_decay": 0.0},
                    "scheduler": {"warmup_steps": 10},
                },
                "logging": {"wandb": "disabled"},
            }
        )
    )
    run = tmp_path / "run"
    rows = train_rows(config, run, nproc=2)
    assert sorted(rows) == [50, 100, 150, 200]
    return data, run


def test_a_tiny_model_copies_across_the_sp_rank_boundary(probe_run, capsys):
    data, run = probe_run

    edges = ",".join(str(e) for e in halves(L))
    assert main(["evaluate", str(run), str(data.eval), "--edges", edges, "--json"]) == 0
    dna = json.loads(capsys.readouterr().out)["modalities"]["dna"]
    (a, b) = dna["by_position"]
    assert (a["lo"], a["hi"], b["lo"], b["hi"]) == (2, L + 2, L + 2, 2 * L + 2)
    assert a["targets"] == b["targets"] == 64 * L
    first_bits, second_bits = a["nats_per_token"] / LN2, b["nats_per_token"] / LN2
    print(f"probe L={L}: first half {first_bits:.4f} bits/base, second {second_bits:.4f}")
    assert abs(first_bits - 2.0) < 0.05, first_bits
    assert second_bits < 0.1, second_bits


def _score(capsys, *args: str) -> tuple[float, float]:
    assert main(["probe", "score", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    first, second = (float(x) for x in re.findall(r"half: ([0-9.]+) bits/base", out))
    return first, second


def test_probe_score_at_any_length_on_windows_of_longer_samples(probe_run, tmp_path, capsys):
    data, run = probe_run
    # the same held-out documents (seed + 1), 3 to a sample, and held-out sets at L/2, 2L
    more = write_probe(
        tmp_path / "more", L, documents=1, eval_documents=64, eval_lengths=[L // 2, 2 * L], pack=3
    )
    m = Manifest.load(str(more.eval))
    assert m.seq_len == 3 * (2 * L + 4) == more.seq_len and m.num_samples == 22
    assert sorted(more.evals) == [L // 2, L, 2 * L]
    one, packed = (
        read_samples((p.parent / Manifest.load(str(p)).shards[0].url).read_bytes(), "eval")
        for p in (data.eval, more.eval)
    )
    assert (packed[0].tokens[2 * L + 4 : 4 * L + 8] == one[1].tokens).all()
    # windows of one document out of 3-document samples: the figures of one-document samples
    alone = _score(capsys, str(run), str(data.eval))
    assert _score(capsys, str(run), str(more.eval), "--length", str(L)) == alone
    # nearer and further back than trained, on one process (sp 1)
    for n in (L // 2, 2 * L):
        first, second = _score(
            capsys, str(run), str(more.evals[n]), "--length", str(n), "--sp", "1", "--nproc", "1"
        )
        with capsys.disabled():
            print(f"trained at L={L}, scored at L={n}: {first:.4f}, {second:.4f} bits/base")
        assert first > 1.9  # nothing predicts a random base
    assert main(["probe", "score", str(run), str(more.evals[2 * L]), "--length", str(L)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds copy documents of L={2 * L}, not L={L}" in err
