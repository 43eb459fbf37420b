"""The pipeline schema (``pipelines/*.yaml``: raw files to shards, ``ulysses-mm prepare``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ulysses_mm.config.parse import ConfigError, check_ranges
from ulysses_mm.config.parse import option as _help
from ulysses_mm.core.checks import CheckError, out_dir
from ulysses_mm.core.storage import Location

ENGINES = ("local", "ray")


@dataclass
class PackConfig:
    """How token documents become fixed-length samples (ulysses_mm.shards.pack)."""

    seq_len: int = _help(
        "Tokens per packed sample N; long documents continue into the next sample.", 1 << 20
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"pack.seq_len must be >= 1, got {self.seq_len}")


@dataclass
class ShardConfig:
    """WebDataset shard rollover (ulysses_mm.shards.writer)."""

    max_bytes: int = _help(
        "Start a new shard when the next sample would take the tar file past this size "
        "(a single larger sample still gets a shard of its own).",
        256 << 20,
        ge=1,
    )
    max_samples: int = _help(
        "Also start a new shard after this many samples (0 = no limit).", 0, ge=0
    )
    partition_bytes: int = _help(
        "Cut the sorted inputs into partitions of about this many input bytes, each packed "
        "and written on its own (part-PPPPP/shard-N.tar) and a unit of work for the executor "
        "(an input larger than this is a partition of its own; 0 = one partition). One "
        "partition is laid out as shard-N.tar.",
        1 << 30,
        ge=0,
    )
    partitions: int = _help(
        "Cut the inputs into this many partitions of about equal input bytes instead "
        "(0 = by partition_bytes).",
        0,
        ge=0,
    )

    def __post_init__(self) -> None:
        check_ranges("shards", self)


@dataclass
class PipelineConfig:
    """Raw files to shards (``pipelines/*.yaml``, run by ``ulysses-mm prepare``).

    Relative paths (sources, tokenizers, output, staging) written in a pipeline file
    resolve against that file's directory; relative paths given as command-line
    overrides resolve against the current directory."""

    name: str = _help("Dataset name, recorded in the manifest.", "")
    sources: list[str] = _help(
        "Input files: paths, globs (** allowed) or fsspec URLs/globs (s3://b/x/*.fa.gz).",
        factory=list,
    )
    tokenizers: list[str] = _help(
        "Tokenizer spec files (tokenizers/*.json), or the name of a spec the package ships "
        "(dna-base) where no such file is; one per modality; their order is the token "
        "space's modality order.",
        factory=list,
    )
    suffixes: dict[str, list[str]] = _help(
        "Extra file suffixes per modality (e.g. {dna: [.seq]}), tried before the built-in "
        "table when routing an input to a tokenizer.",
        factory=dict,
    )
    tokenizer_kinds: dict[str, str] = _help(
        "Extra tokenizer kinds, kind -> 'module:Class', registered before the specs load "
        "(for tokenizers that live outside ulysses_mm).",
        factory=dict,
    )
    pack: PackConfig = _help("Packing.", factory=PackConfig)
    shards: ShardConfig = _help("Shard rollover.", factory=ShardConfig)
    output: str = _help(
        "Dataset directory or fsspec URL (s3://bucket/prefix, memory://x): shards and "
        "manifest.json go there.",
        "",
    )
    storage_options: dict[str, Any] = _help(
        "fsspec storage options for remote sources and output (never recorded).", factory=dict
    )
    staging: str = _help(
        "Local staging directory (each input's tokenized documents, shards before upload); '' = "
        "OUTPUT.staging beside a local output, or a directory in the system temp dir named "
        "after a remote output's URL.",
        "",
    )
    keep_staging: bool = _help("Keep the staging directory after a successful run.", False)
    workers: int = _help(
        "engine=local: tokenizer worker processes (0 = one per CPU core); engine=ray: "
        "partition tasks running at once, and the CPUs of a local Ray it starts (0 = as "
        "many as the cluster has CPUs).",
        0,
    )
    progress: bool = _help("Show a progress bar (tqdm) on stderr.", True)
    engine: str = _help(
        "What runs the partitions: 'local' (a process pool on this machine) or 'ray' (the "
        "tasks of a Ray cluster; pip install 'ulysses-mm[ray]'). Same bytes either way.",
        "local",
    )
    ray_address: str = _help(
        "The Ray cluster to join with engine=ray: 'auto' (the one `ray start` began on this "
        "machine), HOST:PORT, ray://HOST:PORT; '' = start a local Ray.",
        "",
    )

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.output:  # a place to write, checked before any input is read
            try:
                out_dir(self.output, "output")
            except CheckError as e:
                raise ConfigError(str(e)) from None

    def location(self, url: str) -> Location:
        """``url`` (an input, the output) reached with the pipeline's storage_options."""
        return Location(url, self.storage_options)

    @property
    def output_location(self) -> Location:
        """The output directory or URL, reached with storage_options."""
        return self.location(self.output)
