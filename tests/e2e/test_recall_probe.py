"""The retrieval probe: keys planted with a value and asked for again at every distance.

The answers file is checked against the prepared shards themselves; a tiny model trained
a little (so some answers are right and some wrong) is scored by ``probe score`` under
SP 1 and SP 2 and by ``evaluate``, and every bucket's accuracy and bits must be those a
single-process forward of the exported model gives at the same answer positions: the
figures are the model's, not merely present."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from train_data import train_rows

from ulysses_mm.cli import main
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.reader import read_samples
from ulysses_mm.tools import recall
from ulysses_mm.tools.probe import write_probe
from ulysses_mm.train.metrics import LN2

L = 64  # tokens per document
PAIRS = 4


def _samples(manifest_path):
    m = Manifest.load(str(manifest_path))
    out = []
    for shard in m.shards:
        out += read_samples((manifest_path.parent / shard.url).read_bytes(), "probe")
    return m, out


@pytest.fixture(scope="module", params=["dna", "text"])
def recall_run(tmp_path_factory, request):
    tmp_path = tmp_path_factory.mktemp("recall")
    data = write_probe(
        tmp_path / "probe", L, documents=1024, eval_documents=48, seed=0,
        eval_lengths=[2 * L], pack=4, task="recall", pairs=PAIRS, modality=request.param,
    )  # fmt: skip
    config = tmp_path / "recall.yaml"
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
                "data": {"train": str(data.train), "micro_batch_size": 16, "seq_len": L},
                "train": {"steps": 150, "log_every": 50, "seed": 0},
                "deepspeed": {
                    "optimizer": {"lr": 0.003, "weight_decay": 0.0},
                    "scheduler": {"warmup_steps": 10},
                },
                "logging": {"wandb": "disabled"},
            }
        )
    )
    run = tmp_path / "run"
    rows = train_rows(config, run, nproc=1)
    assert sorted(rows) == [50, 100, 150]
    return data, run, request.param


def test_the_answers_file_is_what_the_shards_hold(recall_run):
    data, _, modality = recall_run
    alphabet = recall.ALPHABETS[modality]
    for path, n in ((data.train, L), (data.eval, L), (data.evals[2 * L], 2 * L)):
        m, samples = _samples(path)
        assert m.seq_len == 4 * n  # --pack 4 in every dataset
        assert set(m.tokens) >= {modality} and m.tokens[modality] == m.num_documents * n
        keys = recall.key_ids(m)
        start = m.token_space.range(modality).start
        values = [start + alphabet.local(v) for v in alphabet.values]
        answers = recall.read_answers(m)
        # every pair found (the placement only gives up in documents near the minimum)
        assert len(answers.sample) == PAIRS * m.num_documents
        assert np.all(answers.distance >= recall.MIN_DISTANCE)
        assert answers.distance.max() < n
        tokens = {s.index: s.tokens for s in samples}
        for s, pos, d in zip(answers.sample, answers.position, answers.distance, strict=True):
            t = tokens[int(s)]
            key, value = t[pos - 1], t[pos]
            assert key in keys and value in values
            doc = slice((pos // n) * n, (pos // n + 1) * n)  # documents are n tokens each
            assert int((t[doc] == key).sum()) == 2  # planted once, asked once
            assert t[pos - 1 - d] == key and t[pos - d] == value  # the plant, d back


def _reference(run, manifest_path, tmp_path):
    """Per bucket (answers, right, bits) from one process: the exported model's logits at
    each query key, argmax and cross-entropy against the answer."""
    from transformers import AutoModelForCausalLM

    from ulysses_mm.train.export import export

    model = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "export")).eval()
    m, samples = _samples(manifest_path)
    answers = recall.read_answers(m)
    n = m.seq_len // 4  # one document: windows of n tokens, as probe score cuts them
    edges = recall.bucket_edges(n)
    ids = torch.tensor(np.stack([s.tokens for s in samples]).astype("int64"))
    docs = ids.reshape(-1, n)  # [samples·4, n]: each document alone
    with torch.no_grad():
        logits = model(input_ids=docs).logits.float()
    row_of = {s.index: i for i, s in enumerate(samples)}
    table: dict[int, list[float]] = {}
    for s, p, d in zip(answers.sample, answers.position, answers.distance, strict=True):
        doc, at = row_of[int(s)] * 4 + int(p) // n, int(p) % n
        row, target = logits[doc, at - 1], int(docs[doc, at])
        b = int(np.searchsorted(edges, d, side="right") - 1)
        t = table.setdefault(b, [0, 0, 0.0])
        t[0] += 1
        t[1] += int(row.argmax()) == target
        t[2] += float(torch.nn.functional.cross_entropy(row[None], torch.tensor([target])))
    return {edges[b]: (n, right, ce / n / LN2) for b, (n, right, ce) in table.items()}


def _score(capsys, tmp_path, *args: str) -> dict:
    out = tmp_path / "score.json"
    assert main(["probe", "score", *args, "--json", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return json.loads(out.read_text())


def test_scores_are_the_models_under_any_layout_and_in_evaluate(recall_run, tmp_path, capsys):
    data, run, modality = recall_run
    one = _score(capsys, tmp_path, str(run), str(data.eval), "--sp", "1", "--nproc", "1")
    two = _score(capsys, tmp_path, str(run), str(data.eval), "--sp", "2", "--nproc", "2")
    want = _reference(run, data.eval, tmp_path)
    assert one["answers"] == sum(n for n, _, _ in want.values()) == PAIRS * 48
    assert 0 < one["accuracy"] < 1  # some answers right, some wrong: the comparison bites
    assert one["modality"] == two["modality"] == modality
    for got in (one, two):
        assert [b["lo"] for b in got["buckets"]] == sorted(want)
        for b in got["buckets"]:
            n, right, bits = want[b["lo"]]
            assert b["answers"] == n and b["hi"] == 2 * b["lo"]
            assert math.isclose(b["accuracy"], right / n, abs_tol=1e-9), (b, right, n)
            assert math.isclose(b["bits"], bits, rel_tol=1e-4, abs_tol=1e-4), (b, bits)
    # evaluate on the same dataset, in windows of one document: the same buckets
    args = ["evaluate", str(run), str(data.eval), "--json", "--nproc", "1", "--seq-len", str(L)]
    assert main(args) == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["modalities"][modality]["by_distance"]
    assert [(r["lo"], r["targets"], r["right"]) for r in rows] == [
        (b["lo"], b["answers"], round(b["accuracy"] * b["answers"])) for b in one["buckets"]
    ]
    assert all(
        math.isclose(r["nats_per_token"] / LN2, b["bits"], rel_tol=1e-9)
        for r, b in zip(rows, one["buckets"], strict=True)
    )


def test_rope_at_scoring_length_and_the_curve(recall_run, tmp_path, capsys):
    data, run, _ = recall_run
    longer = str(data.evals[2 * L])
    plain = _score(capsys, tmp_path, str(run), longer, "--nproc", "1")
    linear = _score(
        capsys, tmp_path, str(run), longer, "--nproc", "1", "--rope", "kind=linear,factor=2"
    )
    assert plain["length"] == linear["length"] == 2 * L
    assert plain["answers"] == linear["answers"] == PAIRS * 48
    assert [b["bits"] for b in plain["buckets"]] != [b["bits"] for b in linear["buckets"]]
    assert linear["rope"] == "kind=linear,factor=2"
    # the same documents at the length the model was trained at: refused, one line
    assert main(["probe", "score", str(run), longer, "--length", str(L)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"recall documents of {2 * L} tokens, not {L}" in err
    for bad in ("kind=cubic", "factor", "kind=linear,factr=2"):
        assert main(["probe", "score", str(run), longer, "--rope", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--rope" in err, err
    png = tmp_path / "curve.png"
    assert (
        main(["probe", "score", str(run), str(data.eval), "--nproc", "1", "--png", str(png)]) == 0
    )
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (880, 550)
        pixels = np.asarray(im.convert("RGB"))
    # the curve's colour (matplotlib's C0) is drawn
    assert int((np.abs(pixels.astype(int) - (31, 119, 180)).sum(-1) < 30).sum()) > 100
