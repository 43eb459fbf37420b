"""Every shipped YAML loads into its schema (litgpt test_config_hub style): configs/ into
RunConfig, pipelines/ into PipelineConfig, so hand-edited files cannot drift from the code."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ulysses_mm.config import ConfigError, PipelineConfig, RunConfig, load_config, read_yaml
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.storage import expand_braces
from ulysses_mm.shards.prepare.route import route
from ulysses_mm.shards.prepare.run import load_pipeline_config
from ulysses_mm.tokenize import registry
from ulysses_mm.tools.estimate import EstimateOptions
from ulysses_mm.tools.estimate.stages import check_stages_fit, estimate_stages, stage_world

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
PIPELINES = sorted((REPO / "pipelines").glob("*.yaml"))


def test_there_are_files_to_check():
    assert CONFIGS, "configs/*.yaml missing"
    names = {p.stem for p in PIPELINES}
    assert {"dna", "audio", "video", "mixed"} <= names


# the length of the shards each shipped config trains on (its data.seq_len is 0, the
# manifest's): the demo's for the CPU configs, the length its header names, else the
# shipped pipelines' pack.seq_len
SHARD_LENGTH = {"debug-tiny": 8192, "debug-mqa": 8192, "small": 8192, "debug-stages": 16384}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_run_config_loads(path: Path):
    cfg = load_config(RunConfig, path)
    assert isinstance(cfg, RunConfig)


def test_every_shipped_config_has_its_shard_length():
    pack = {load_config(PipelineConfig, p).pack.seq_len for p in PIPELINES}
    assert pack == {1 << 20}
    assert set(SHARD_LENGTH) <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_run_config_lays_out_and_estimates(path: Path):
    """Each stage of a shipped config (a run without stages is one) passes its layout
    check on the world ``ulysses-mm estimate`` assumes (parallel.sp × dp, else the largest
    sp of its stages) and gets an estimate of that layout; one with train.gpu_mem_gib fits
    it, as the train pre-flight checks."""
    cfg = load_config(RunConfig, path)
    shards = SHARD_LENGTH.get(path.stem, 1 << 20)
    world = stage_world(cfg)
    budget = cfg.train.gpu_mem_gib or None
    rows = estimate_stages(cfg, world, shards, opts=EstimateOptions(gpu_mem_gib=budget))
    assert [r.stage.index for r in rows] == list(range(max(1, len(cfg.train.stages))))
    for row in rows:
        p, m, step = row.stage.cfg.parallel, row.stage.cfg.model, row.est.step
        seq_len = row.stage.seq_len or shards
        layout = Layout.from_config(
            p,
            world,
            num_heads=m.num_attention_heads,
            num_kv_heads=m.num_key_value_heads,
            seq_len=seq_len,
        )
        assert layout == Layout(world // p.sp, p.sp, p.ring, p.head_groups)
        assert (step.layout, step.seq_len) == (layout, seq_len)
        assert step.micro_batch == row.stage.cfg.data.micro_batch_size
        assert 0 < row.est.peak <= row.est.total < math.inf
        assert row.est.fits is (True if budget else None)
    if budget:
        check_stages_fit(cfg, world, shards)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_config_loads(path: Path):
    cfg = load_config(PipelineConfig, path)
    assert cfg.sources and cfg.tokenizers and cfg.output
    assert cfg.pack.seq_len >= 1
    # every tokenizer spec is a JSON file in the repository's tokenizers/ directory
    resolved = load_pipeline_config(path, cwd=Path("/nonexistent-cwd"))
    for spec in resolved.tokenizers:
        p = Path(spec)
        assert p.suffix == ".json" and p.parent == REPO / "tokenizers", spec
    # sources point into the repository (paths relative to the pipeline file)
    for src in resolved.sources:
        assert Path(src).is_relative_to(REPO), src
    assert Path(resolved.output).is_relative_to(REPO / "build")


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_pipeline_sources_route_to_their_tokenizers(path: Path):
    """Each source glob's suffixes reach a tokenizer the pipeline names."""
    cfg = load_config(PipelineConfig, path)
    specs = [read_yaml(t) for t in load_pipeline_config(path).tokenizers]  # JSON is YAML
    kinds = {s["modality"]: s["kind"] for s in specs}
    # every shipped tokenizer kind declares the files it reads
    assert all(registry.kind(k).suffixes for k in kinds.values()), kinds
    for pattern in cfg.sources:
        for alt in expand_braces(pattern):
            name = Path(alt).name.replace("*", "x")
            assert route(name, kinds, cfg.suffixes) is not None, (path.name, alt)


def test_pipeline_paths_resolve_against_file_and_cwd(tmp_path: Path):
    sub = tmp_path / "specs"
    sub.mkdir()
    (sub / "p.yaml").write_text(
        "sources: [data/*.fa, s3://bucket/x/*.fa]\ntokenizers: [../tok/dna.json]\noutput: out\n"
    )
    cfg = load_pipeline_config(sub / "p.yaml", cwd=tmp_path / "elsewhere")
    assert cfg.sources == [str(sub / "data/*.fa"), "s3://bucket/x/*.fa"]
    assert cfg.tokenizers == [str(tmp_path / "tok/dna.json")]
    assert cfg.output == str(sub / "out")
    cfg = load_pipeline_config(
        sub / "p.yaml", ["output=o2", "sources=[in/a.fa]"], cwd=tmp_path / "elsewhere"
    )
    assert cfg.output == str(tmp_path / "elsewhere" / "o2")
    assert cfg.sources == [str(tmp_path / "elsewhere" / "in/a.fa")]
    assert cfg.tokenizers == [str(tmp_path / "tok/dna.json")]  # untouched by overrides


def test_pipeline_overrides_replace_the_value_at_their_key(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text("suffixes: {dna: [.seq], audio: [.snd]}\npack: {seq_len: 64}\n")
    assert load_pipeline_config(p).suffixes == {"dna": [".seq"], "audio": [".snd"]}
    assert load_pipeline_config(p, ["suffixes={}"]).suffixes == {}
    cfg = load_pipeline_config(p, ["suffixes={video: [.vid]}", "shards.max_samples=3"])
    assert cfg.suffixes == {"video": [".vid"]}
    assert (cfg.pack.seq_len, cfg.shards.max_samples) == (64, 3)


def test_pipeline_config_rejects_bad_keys_and_values(tmp_path: Path):
    p = tmp_path / "p.yaml"
    p.write_text("sources: [a]\npack: {seq_lenn: 4}\n")
    with pytest.raises(ConfigError, match=r"pack\.seq_lenn.*did you mean 'pack\.seq_len'"):
        load_pipeline_config(p)
    p.write_text("pack: {seq_len: 0}\n")
    with pytest.raises(ConfigError, match=r"pack\.seq_len must be >= 1"):
        load_pipeline_config(p)
    p.write_text("workers: many\n")
    with pytest.raises(ConfigError, match="workers: expected an integer"):
        load_pipeline_config(p)
    with pytest.raises(ConfigError, match=r"shards\.max_bytes must be >= 1"):
        load_pipeline_config(None, ["shards.max_bytes=0"])


def test_yaml_is_read_safely(tmp_path: Path):
    p = tmp_path / "evil.yaml"
    p.write_text("sources: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        read_yaml(p)
