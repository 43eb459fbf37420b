"""Per-modality weights inside a mixed manifest: over a run each modality's share of the
manifest's tokens is its weight within 2 %, the order is a function of (seed, epoch) and
survives a change of dp, and what the config gets wrong fails in the parent in one line.

The mixed manifest is the shipped mixed pipeline on the sample files of tests/data (DNA,
speech and a video clip, inputs in name order, so the modalities interleave and a few
samples straddle two of them)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, require_fixture
from train_data import learnable_fasta, train_rows

from ulysses_mm.cli import main
from ulysses_mm.config import ConfigError, RunConfig, load_config
from ulysses_mm.core.format import SEG_LENGTH, SEG_MODALITY
from ulysses_mm.core.storage import expand_sources
from ulysses_mm.loader.mixing import mix_error, modality_pools
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest, ManifestError
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare

SEQ = 2048
WEIGHTS = {"video": 0.5, "audio": 0.3, "dna": 0.2}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Manifest:
    pipeline = REPO / "pipelines" / "mixed.yaml"
    cfg = load_pipeline_config(
        pipeline,
        [
            f"output={tmp_path_factory.mktemp('mixed') / 'mixed'}",
            f"pack.seq_len={SEQ}",
            "shards.max_samples=16",
            "workers=0",
            "progress=false",
        ],
    )
    require_fixture(
        all(Path(t).is_file() for t in cfg.tokenizers) and bool(expand_sources(cfg.sources)[0]),
        "the mixed pipeline's tokenizer specs and tests/data sample files",
    )
    result = prepare(cfg, out=io.StringIO())
    return Manifest.load(result.location)


@pytest.fixture(scope="module")
def dna(tmp_path_factory, mixed) -> Manifest:
    """DNA only, in the mixed pipeline's token space (so it mixes with ``mixed`` in a run)."""
    root = tmp_path_factory.mktemp("dna")
    (root / "src").mkdir()
    learnable_fasta(root / "src" / "dna.fa", records=60, length=2000, seed=2)
    cfg = load_pipeline_config(
        REPO / "pipelines" / "mixed.yaml",
        [
            f"sources=[{root / 'src' / 'dna.fa'}]",
            f"output={root / 'dna'}",
            f"pack.seq_len={SEQ}",
            "shards.max_samples=16",
            "progress=false",
        ],
    )
    return Manifest.load(prepare(cfg, out=io.StringIO()).location)


def _counted(samples) -> np.ndarray:
    """Real tokens per modality (token-space order) in samples, from their segment tables."""
    out = np.zeros(3, dtype=np.int64)
    for s in samples:
        np.add.at(out, s.segments[:, SEG_MODALITY], s.segments[:, SEG_LENGTH])
    return out


def test_the_manifest_records_each_samples_modality_tokens(mixed):
    assert mixed.held_modalities == ["dna", "audio", "video"]
    table = mixed.sample_tokens()
    read = ShardStream(mixed, 0, 1, mixed.num_samples, StreamOptions(shuffle=False)).next_batch()
    assert [s.index for s in read] == list(range(mixed.num_samples))
    for s in read:
        assert table[s.index].tolist() == _counted([s]).tolist()
    straddle = int(((table > 0).sum(axis=1) > 1).sum())
    assert 1 <= straddle < mixed.num_samples // 4  # some samples hold two modalities
    assert Manifest.from_dict(json.loads(mixed.to_json())).modality_runs == mixed.modality_runs


def test_modalities_get_their_token_share_over_a_run(mixed, dna):
    dp, mb, steps = 2, 2, 500
    entries = [(dna, 0.4), (mixed, 0.6, WEIGHTS)]
    streams = [
        ShardStream(entries, r, dp, mb, StreamOptions(seed=7, shuffle_buffer=8)) for r in range(dp)
    ]
    st = streams[0]
    assert [s.modality for s in st.order.sources] == ["", "dna", "audio", "video"]
    seen = [s for _ in range(steps) for rank in streams for s in rank.next_batch()]
    src, idx, _ = st.order.span(st.order.start(), st.cursor.position)
    assert [s.index for s in seen] == idx.tolist()  # the global order, every rank together
    drawn = st.tally.drawn_tokens()[1]
    # what the manifest's record says was drawn from it is what the ranks read
    assert drawn.tolist() == _counted(s for s, k in zip(seen, src) if k >= 1).tolist()
    err = st.tally.modality_mix_error()
    shares = drawn / drawn.sum()
    manifest_err = mix_error(
        [int(st.cursor.counts[0]), int(st.cursor.counts[1:].sum())], [0.4, 0.6]
    )
    print(
        f"over {len(seen)} samples: token shares dna {shares[0]:.4f} audio {shares[1]:.4f} "
        f"video {shares[2]:.4f} (weights {WEIGHTS}); modality mix error {err:.4f}, "
        f"manifest mix error {manifest_err:.4f}"
    )
    assert err <= 0.02 and manifest_err <= 0.02
    want = [WEIGHTS[n] for n in ("dna", "audio", "video")]
    assert err == pytest.approx(max(abs(shares - want) / want))
    # what training logs as mix/<label>: manifests' sample shares, modalities' token shares
    logged = st.mix_shares()
    assert sorted(logged) == ["dna", "mixed", "mixed/audio", "mixed/dna", "mixed/video"]
    assert logged["mixed"] == pytest.approx(st.cursor.counts[1:].sum() / len(seen))
    assert [logged[f"mixed/{n}"] for n in ("dna", "audio", "video")] == pytest.approx(shares)


def test_the_order_is_a_function_of_seed_and_epoch_and_survives_a_dp_change(mixed):
    entries = [(mixed, 1.0, WEIGHTS)]

    def run(dp: int, mb: int, steps: int, seed: int = 3, state=None):
        streams = [
            ShardStream(entries, r, dp, mb, StreamOptions(seed=seed, shuffle_buffer=8))
            for r in range(dp)
        ]
        if state is not None:
            for st in streams:
                st.load_state_dict(state)
        seen = [s.index for _ in range(steps) for st in streams for s in st.next_batch()]
        assert len({str(st.state_dict()) for st in streams}) == 1  # every rank agrees
        return seen, streams[0].state_dict(), streams[-1].tally.drawn_tokens()[0].tolist()

    whole, _, drawn = run(1, 1, 240)
    assert run(1, 1, 240)[0] == whole
    assert run(1, 1, 240, seed=4)[0] != whole
    head, state, _ = run(2, 3, 10)  # 60 samples: every video sample several times over
    tail, _, resumed = run(3, 2, 30, state=state)
    assert head + tail == whole
    assert resumed == drawn  # the tokens drawn so far are carried across the resume
    # a checkpoint of a run without modality weights does not resume into one with them
    plain = ShardStream(mixed, 0, 1, 1).state_dict()
    with pytest.raises(ValueError, match="belongs to other shards"):
        ShardStream(entries, 0, 1, 1).load_state_dict(plain)


def test_a_modality_visits_its_samples_once_an_epoch_shard_by_shard(mixed):
    st = ShardStream([(mixed, 1.0, WEIGHTS)], 0, 1, 1, StreamOptions(seed=5, shuffle_buffer=4))
    table = mixed.sample_tokens()
    for source in st.order.sources:
        k = mixed.token_space.modalities.index(source.modality)
        assert (np.argmax(table[source.members], axis=1) == k).all()  # the samples it leads
        orders = [source.order(e) for e in range(3)]
        for order in orders:
            assert sorted(order.tolist()) == source.members.tolist()
        assert orders[0].tolist() != orders[1].tolist()
        # a shard's samples stay together (up to the buffer's blending at the seams)
        shards = source.shards_of(orders[0])
        blocks = 1 + int((shards[1:] != shards[:-1]).sum())
        assert blocks <= 3 * len(np.unique(shards)), (source.modality, blocks)
    members = np.concatenate([s.members for s in st.order.sources])
    assert sorted(members.tolist()) == list(range(mixed.num_samples))  # every modality weighted


def test_weights_the_samples_cannot_give_are_refused():
    names = ["dna", "audio", "video"]
    # every sample 60/40 one way or the other: no rates give audio 90 % of the tokens
    even = np.array([[0, 60, 40]] * 10 + [[0, 40, 60]] * 10)
    with pytest.raises(ValueError, match=r"m.json: its samples mix modalities too evenly"):
        modality_pools(even, names, {"audio": 0.9, "video": 0.1}, "m.json")
    # half and half everywhere: no sample is mostly video
    with pytest.raises(ValueError, match=r"m.json: no sample is mostly video"):
        modality_pools(np.tile([[0, 100, 100]], (20, 1)), names, {"audio": 1, "video": 1}, "m.json")
    # mostly-pure samples do: the solved rates give the weights exactly in expectation
    table = np.array([[0, 90, 10]] * 10 + [[0, 30, 70]] * 5)
    pools = modality_pools(table, names, {"audio": 1, "video": 1}, "m.json")
    per_draw = sum(p.rate * table[p.members].mean(axis=0) for p in pools)
    assert per_draw[1:] / per_draw[1:].sum() == pytest.approx([0.5, 0.5])
    assert pools[1].rate == pytest.approx(2 * pools[0].rate)  # 90a + 30v = 10a + 70v
    # the video pool is 70 % video at best: 75 % cannot be had
    with pytest.raises(ValueError, match=r"too evenly to give audio 0.25, video 0.75"):
        modality_pools(table, names, {"audio": 1, "video": 3}, "m.json")


def test_the_config_reads_weights_and_modalities_beside_plain_weights():
    cfg = load_config(
        RunConfig,
        None,
        ["data.train={a/manifest.json: 2, b/manifest.json: {modalities: {video: 0.5, dna: 0.5}}}"],
    )
    a, b = cfg.data.train.values()  # type: ignore[union-attr]
    assert a == 2.0 and b.weight == 1.0 and b.modalities == {"video": 0.5, "dna": 0.5}
    with pytest.raises(ConfigError, match=r"did you mean 'data.train.b.weight'"):
        load_config(RunConfig, None, ["data.train={b: {wieght: 2}}"])


# ------------------------------------------------------------------ preflight


def _config(tmp: Path, train: dict) -> Path:
    cfg = {
        "model": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
        "data": {"train": train},
        "train": {"out_dir": str(tmp / "run")},
        "logging": {"wandb": "disabled"},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr("ulysses_mm.parallel.launch.run_world", refuse)


@pytest.mark.parametrize(
    ("modalities", "expect"),
    [
        ({"vidoe": 0.5, "audio": 0.5}, "unknown modality 'vidoe' (the token space has dna, audio"),
        ({"video": 0.0, "audio": 1.0}, "the weight of video is 0.0; give a positive one"),
        ({"video": -1.0, "audio": 1.0}, "the weight of video is -1.0; give a positive one"),
    ],
)
def test_modality_weight_errors_fail_in_the_parent(
    tmp_path, mixed, no_processes, capsys, modalities, expect
):
    train = {mixed.location: {"weight": 1.0, "modalities": modalities}}
    assert main(["train", str(_config(tmp_path, train))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"data.train: {mixed.location}: {expect}" in err, err


def test_a_modality_the_manifest_lacks_fails_in_the_parent(tmp_path, no_processes, capsys):
    # the mixed pipeline's token space (dna, audio, video) but DNA inputs only
    cfg = load_pipeline_config(
        REPO / "pipelines" / "mixed.yaml",
        [
            f"sources=[{REPO / 'tests' / 'data' / '*.fa'}]",
            f"output={tmp_path / 'dna-only'}",
            f"pack.seq_len={SEQ}",
            "progress=false",
        ],
    )
    require_fixture(
        all(Path(t).is_file() for t in cfg.tokenizers) and bool(expand_sources(cfg.sources)[0]),
        "the mixed pipeline's tokenizer specs and tests/data sample files",
    )
    location = prepare(cfg, out=io.StringIO()).location
    train = {location: {"modalities": {"dna": 0.5, "video": 0.5}}}
    assert main(["train", str(_config(tmp_path, train))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"data.train: {location}: holds no video tokens (it holds dna)" in err, err


def test_an_older_manifest_is_one_line_only_when_modalities_are_weighted(
    tmp_path, mixed, no_processes, capsys
):
    old = tmp_path / "old"
    shutil.copytree(Path(mixed.location).parent, old)
    data = json.loads((old / "manifest.json").read_text())
    del data["modality_runs"]  # as prepare wrote it before it recorded them
    (old / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.load(str(old / "manifest.json"))
    assert manifest.modality_runs is None
    assert len(ShardStream(manifest, 0, 1, 2).next_batch()) == 2  # read as a whole: fine
    with pytest.raises(ManifestError, match="records no per-sample modality counts"):
        manifest.sample_tokens()
    train = {str(old / "manifest.json"): {"modalities": WEIGHTS}}
    assert main(["train", str(_config(tmp_path, train))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "records no per-sample modality counts" in err and str(old) in err, err


def test_the_plan_hands_the_modality_weights_to_the_loader(mixed, dna):
    from ulysses_mm.train.plan import plan_run

    train = f"data.train={{{dna.location}: 1, {mixed.location}: {{weight: 3, modalities: {{audio: 1, video: 1}}}}}}"
    plan = plan_run(load_config(RunConfig, None, [train]), world=1)
    assert [(m.location, w) for m, w in plan.sources] == [
        (dna.location, 1.0),
        (mixed.location, 3.0),
    ]
    assert plan.modalities == [{}, {"audio": 1.0, "video": 1.0}]
    st = ShardStream(plan.stream_sources, 0, 1, 1)
    assert st.tally.source_labels == ["dna", "mixed/audio", "mixed/video"]  # no mixed/dna
    assert sum(st.order.weights[1:]) == pytest.approx(0.75)


def test_a_run_logs_each_modalitys_token_share(tmp_path, mixed, dna):
    """Through the trainer (one process): what it draws and logs is the loader's."""
    train = {dna.location: 1.0, mixed.location: {"weight": 3.0, "modalities": WEIGHTS}}
    cfg = yaml.safe_load(_config(tmp_path, train).read_text())
    cfg["model"].update(intermediate_size=64, num_hidden_layers=1, loss_tile_tokens=512)
    cfg["train"].update(steps=4, checkpoint_every=0)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = train_rows(path, tmp_path / "run")
    last = rows[max(rows)]
    st = ShardStream([(dna, 1.0), (mixed, 3.0, WEIGHTS)], 0, 1, 1, StreamOptions(shuffle_buffer=16))
    for _ in range(4):
        st.next_batch()
    want = {f"mix/{k}": v for k, v in st.mix_shares().items()}
    assert {k: v for k, v in last.items() if k.startswith("mix/")} == pytest.approx(want)
    assert "mix/mixed/video" in want and "mix/dna" in want
