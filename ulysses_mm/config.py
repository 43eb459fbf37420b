"""Typed configuration: dataclasses are the schema, YAML only gives values.

Precedence, lowest to highest: the dataclass defaults, the YAML file, then
``section.key=value`` arguments on the command line. Every value is checked against the
field's type; an unknown key or a wrong type raises :class:`ConfigError` naming the key's
full path (``model.hidden_size``) and, for unknown keys, the closest valid name.

The two top-level schemas are :class:`RunConfig` (``configs/*.yaml``: a training or
verification run) and :class:`PipelineConfig` (``pipelines/*.yaml``: raw files to shards).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key's full path."""


def _help(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field with help text (shown by ``ulysses-mm config --help-keys``)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """A Llama-style decoder. The architecture fields map one-to-one onto
    ``transformers.LlamaConfig`` (see :meth:`to_llama_config_kwargs`); ``qk_norm`` makes it
    a Qwen3, ``attention_bias`` a Qwen2."""

    hidden_size: int = _help("Model width D (LlamaConfig.hidden_size).", 64)
    intermediate_size: int = _help("SwiGLU inner width (LlamaConfig.intermediate_size).", 172)
    num_hidden_layers: int = _help("Decoder layers.", 2)
    num_attention_heads: int = _help("Query heads H.", 4)
    num_key_value_heads: int = _help("Key/value heads (GQA/MQA when < num_attention_heads).", 4)
    head_dim: int | None = _help(
        "Per-head width; defaults to hidden_size / num_attention_heads.", None
    )
    rms_norm_eps: float = _help("RMSNorm epsilon.", 1e-5)
    rope_theta: float = _help("RoPE base frequency.", 10000.0)
    max_position_embeddings: int = _help(
        "Longest position id the model is meant for (positions restart per document).", 1 << 20
    )
    initializer_range: float = _help(
        "Std of the normal init of linear and embedding weights.", 0.02
    )
    modalities: dict[str, int] = _help(
        "Vocabulary size per modality, in token-space order. Empty: take it from the data "
        "manifest at training time.",
        factory=dict,
    )
    loss_weights: dict[str, float] = _help(
        "Per-modality loss weight (missing modalities weigh 1.0). The total loss is the "
        "weighted mean of the per-modality token-mean losses present in the global batch.",
        factory=dict,
    )
    loss_tile_tokens: int = _help(
        "Tokens per loss tile: [tile, vocab] logits are the most ever materialised.", 8192
    )
    mlp_tile_tokens: int = _help("Tokens per MLP tile (0 = no MLP tiling).", 0)
    activation_checkpointing: bool = _help("Recompute each decoder layer in backward.", False)
    qk_norm: bool = _help(
        "RMSNorm of each query and key head before RoPE (Qwen3); export writes a Qwen3 model.",
        False,
    )
    attention_bias: bool = _help(
        "Biases on the q/k/v projections (Qwen2); export writes a Qwen2 model.", False
    )
    init_from: str = _help(
        "A transformers Llama/Qwen2/Qwen3 checkpoint directory (safetensors) to start from: "
        "its backbone loads as is, its embedding and LM-head rows go to the range of "
        "model.text_modality ('' = random init). `ulysses-mm config --from-hf DIR` prints "
        "the matching model section.",
        "",
    )
    text_modality: str = _help(
        "The modality whose id range takes the init_from checkpoint's vocabulary.", "text"
    )
    offload_checkpoints: bool = _help(
        "Keep each checkpointed layer input in (pinned) host memory between forward and its "
        "recompute (needs activation_checkpointing).",
        False,
    )
    layer_tile_tokens: int = _help(
        "Tokens per tile of everything token-wise in a decoder layer (norms, projections, "
        "MLP, residual adds) and of the final norm, each tile recomputed in backward "
        "(0 = no layer tiling).",
        0,
    )

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model.hidden_size ({self.hidden_size}) is not divisible by "
                    f"model.num_attention_heads ({self.num_attention_heads}); set model.head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim ({self.head_dim}) must be even for RoPE")
        for name, size in self.modalities.items():
            if size < 1:
                raise ConfigError(f"model.modalities.{name} must be >= 1, got {size}")
        if self.loss_tile_tokens < 1:
            raise ConfigError("model.loss_tile_tokens must be >= 1")
        if self.mlp_tile_tokens < 0:
            raise ConfigError("model.mlp_tile_tokens must be >= 0")
        if self.layer_tile_tokens < 0:
            raise ConfigError("model.layer_tile_tokens must be >= 0")
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise ConfigError(
                "model.offload_checkpoints needs model.activation_checkpointing=true "
                "(it moves the checkpointed layer inputs to the host)"
            )

    def to_llama_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the equivalent ``transformers.LlamaConfig`` (backbone only)."""
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )


AttentionKernel = Literal["auto", "flash_varlen", "sdpa_varlen", "sdpa_dense", "flex"]


@dataclass
class ParallelConfig:
    """How processes are laid out: world = dp × sp, sp innermost (ranks of one SP group
    are consecutive, so on GPUs they share a node)."""

    sp: int = _help("Sequence-parallel size P (Ulysses all-to-all group).", 1)
    dp: int = _help("Data-parallel size D; 0 = world_size / sp.", 0)
    ring: int = _help(
        "Ring size R inside each SP group (hybrid Ulysses × ring): sp = U × R, Ulysses over "
        "U = sp / R consecutive ranks, ring attention across the R groups; U must divide the "
        "heads and 2·sp the sequence. 1 = pure Ulysses; R = sp = pure ring.",
        1,
    )
    backend: Literal["auto", "gloo", "nccl"] = _help(
        "torch.distributed backend; auto = nccl when every local rank has its own GPU, else gloo.",
        "auto",
    )
    attention: AttentionKernel = _help(
        "Local attention kernel run on H/P heads: auto = flash_varlen on a GPU in bf16/fp16 "
        "when flash-attn loads, else sdpa_varlen; flash_varlen in fp32 is refused.",
        "auto",
    )
    timeout_s: int = _help("Collective timeout in seconds (a hang becomes an error).", 600)

    def __post_init__(self) -> None:
        if self.sp < 1:
            raise ConfigError(f"parallel.sp must be >= 1, got {self.sp}")
        if self.dp < 0:
            raise ConfigError(f"parallel.dp must be >= 0, got {self.dp}")
        if self.ring < 1 or self.sp % self.ring:
            raise ConfigError(
                f"parallel.ring must be >= 1 and divide parallel.sp={self.sp}, got {self.ring}"
            )


@dataclass
class TrainSource:
    """One manifest of a mix given as a mapping: ``{weight: 1.0, modalities: {video: 0.5,
    audio: 0.3, dna: 0.2}}``."""

    weight: float = _help("The manifest's share of the samples (against the others').", 1.0)
    modalities: dict[str, float] = _help(
        "Weights of the modalities inside the manifest: each gets its weight's share of the "
        "manifest's tokens (the samples a modality not named here dominates are left out; "
        "{} = the manifest as it comes).",
        factory=dict,
    )


@dataclass
class DataConfig:
    """Where training samples come from."""

    train: str | dict[str, float | TrainSource] = _help(
        "Manifest URL or path of the training shards (file, http(s), s3, gs), or several "
        "as {manifest: weight}: each then gives its weight's share of the samples; "
        "{manifest: {weight: w, modalities: {video: 0.5, audio: 0.5}}} also weights the "
        "modalities inside a manifest by their share of its tokens.",
        "",
    )
    eval: str = _help("Manifest URL or path of held-out shards ('' = no evaluation).", "")
    seq_len: int = _help("Tokens per sample N; 0 = the manifest's seq_len.", 0)
    micro_batch_size: int = _help("Samples per DP rank per micro-step.", 1)
    seed: int = _help("Seed of the sample order (a function of seed, epoch, manifest).", 0)
    shuffle: bool = _help("Shuffle shards and samples each epoch.", True)
    shuffle_buffer: int = _help(
        "Shuffle buffer: each sample moves by fewer than this many positions, which blends "
        "the seams between shards (capped at half the smallest shard; 0 = off).",
        16,
    )
    retries: int = _help("Attempts to open a shard URL before giving up.", 5)
    retry_backoff_s: float = _help("First retry delay; doubled each attempt.", 0.5)
    connect_timeout_s: float = _help("Seconds to wait for a storage server to connect.", 10.0)
    read_timeout_s: float = _help(
        "Seconds of silence from a storage server before a read is retried.", 60.0
    )
    prefetch_bytes: int = _help(
        "Bytes of upcoming shards fetched on a background thread (0 = fetch in the step).",
        1 << 30,
    )
    cache_dir: str = _help(
        "Node-local directory the ranks of a node share, so each shard is downloaded once "
        "per node ('' = no cache).",
        "",
    )
    cache_bytes: int = _help(
        "Most bytes cache_dir holds; least recently used shards are removed.", 64 << 30
    )
    storage_options: dict[str, Any] = _help(
        "fsspec storage options (for example endpoint_url for an S3-API server).", factory=dict
    )


@dataclass
class OptimizerConfig:
    type: Literal["AdamW", "Adam", "SGD"] = _help("DeepSpeed optimizer type.", "AdamW")
    lr: float = _help("Peak learning rate.", 3e-4)
    betas: list[float] = _help("Adam betas.", factory=lambda: [0.9, 0.95])
    eps: float = _help("Adam epsilon.", 1e-8)
    weight_decay: float = _help("Decoupled weight decay.", 0.1)
    torch_adam: bool = _help(
        "Use torch's Adam inside DeepSpeed (no JIT-compiled C++/CUDA op).", True
    )


@dataclass
class SchedulerConfig:
    type: Literal["WarmupCosineLR", "WarmupLR", "none"] = _help(
        "LR schedule: linear warm-up to the peak, then a cosine to min_lr_ratio "
        "(WarmupCosineLR) or flat (WarmupLR); none = the optimizer's lr throughout.",
        "WarmupCosineLR",
    )
    warmup_steps: int = _help(
        "Linear warm-up steps W: step k <= W runs at lr·k/W, step W at the peak (0 = from step 1).",
        10,
    )
    min_lr_ratio: float = _help("Final LR as a fraction of the peak (cosine).", 0.1)


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed engine. ``extra`` is merged last into the generated ds_config for
    options this schema does not name."""

    zero_stage: Literal[0, 1, 2, 3] = _help("ZeRO stage.", 0)
    precision: Literal["fp32", "bf16", "fp16"] = _help("Training precision.", "fp32")
    gradient_accumulation_steps: int = _help("Micro-steps per optimizer step.", 1)
    gradient_clipping: float = _help("Clip the global grad norm to this (0 = off).", 1.0)
    offload_optimizer: Literal["none", "cpu"] = _help("ZeRO optimizer-state offload.", "none")
    offload_param: Literal["none", "cpu"] = _help("ZeRO-3 parameter offload.", "none")
    optimizer: OptimizerConfig = _help("Optimizer.", factory=OptimizerConfig)
    scheduler: SchedulerConfig = _help("LR schedule.", factory=SchedulerConfig)
    extra: dict[str, Any] = _help("Raw ds_config entries merged last.", factory=dict)


@dataclass
class TrainConfig:
    steps: int = _help("Optimizer steps to run.", 100)
    seed: int = _help("Seed of model initialisation.", 0)
    out_dir: str = _help("Run directory: metrics, checkpoints, plots.", "runs/debug")
    log_every: int = _help("Log metrics every K steps.", 1)
    eval_every: int = _help("Evaluate every K steps (0 = never).", 0)
    eval_batches: int = _help("Micro-batches per evaluation.", 4)
    checkpoint_every: int = _help("Save a checkpoint every K steps (0 = only at the end).", 0)
    keep_checkpoints: int = _help("Checkpoints kept on disk (oldest removed first; 0 = all).", 3)
    peak_tflops: float = _help(
        "Peak device TFLOP/s for the MFU estimate (0 = the figure of a known GPU at "
        "deepspeed.precision; no MFU is logged on other devices).",
        0.0,
    )


@dataclass
class LoggingConfig:
    wandb: Literal["auto", "online", "offline", "disabled"] = _help(
        "W&B mode; auto = online when an API key is set, else offline.", "auto"
    )
    project: str = _help("W&B project.", "ulysses-mm")
    run_name: str = _help("W&B run name ('' = generated).", "")
    jsonl: bool = _help("Also append every logged step to RUN_DIR/metrics.jsonl.", True)


@dataclass
class RunConfig:
    """A training or verification run (``configs/*.yaml``)."""

    model: ModelConfig = _help("Backbone and heads.", factory=ModelConfig)
    parallel: ParallelConfig = _help("Process layout.", factory=ParallelConfig)
    data: DataConfig = _help("Training data.", factory=DataConfig)
    deepspeed: DeepSpeedConfig = _help("DeepSpeed engine.", factory=DeepSpeedConfig)
    train: TrainConfig = _help("Loop, checkpoints, evaluation.", factory=TrainConfig)
    logging: LoggingConfig = _help("Metrics sinks.", factory=LoggingConfig)


# ------------------------------------------------------------------ schema machinery


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _closest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return match[0] if match else ""


def _is_mapping_type(tp: Any) -> bool:
    return get_origin(tp) is dict or tp is dict or dataclasses.is_dataclass(tp)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (converted where lossless)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors, alike = [], []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
                if isinstance(value, Mapping) == _is_mapping_type(arg):
                    alike.append(str(e))  # the error of the type the value has the shape of
        if len(errors) > 1 and len(alike) == 1:
            errors = alike
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{path}: {value!r} matches no type of {tp}"
        )
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(f"{path}: {value!r} is not one of {list(allowed)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping for section {_type_name(tp)}, got {value!r}"
            )
        return from_dict(tp, value, path)  # type: ignore[arg-type]
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_coerce(kt, k, f"{path}"): _coerce(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            near = _closest(str(key), names)
            hint = f"; did you mean '{path + '.' if path else ''}{near}'?" if near else ""
            raise ConfigError(f"unknown key '{full}'{hint}")
        kwargs[key] = _coerce(hints[key], value, full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> dict[str, Any]:
    """The plain-data form of a config (round-trips through :func:`from_dict`)."""
    return dataclasses.asdict(obj)


class _Replace(dict):
    """A mapping given whole by an override (``model.modalities={text: 8}``): it replaces
    the value at its key, where a mapping read from a file merges into the one below it."""


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["model.hidden_size=128", "data.train=s3://b/m.json"]`` to a nested mapping.

    Values are parsed as YAML scalars/flows (``3``, ``true``, ``[1, 2]``, ``{a: 1}``). An
    override replaces the value at its key: merged with :func:`deep_merge`, a mapping
    value does not merge into the file's mapping at that key (``'model.modalities={}'``
    empties it), while overrides of different keys of one section still combine."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"override '{item}': the value is not YAML ({problem}); a string with "
                "YAML's special characters needs quotes inside the shell's: "
                f"""{key}='"..."'"""
            ) from None
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{item}' conflicts with an earlier override of '{part}'"
                )
            node = child
        node[parts[-1]] = _Replace(value) if isinstance(value, dict) else value
    return nested


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else replaces, and so
    does a mapping that came whole from an override (see :func:`parse_overrides`). The
    mappings of ``top`` are copied into plain dicts."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping):
            below = out.get(key)
            merge = isinstance(below, Mapping) and not isinstance(value, _Replace)
            out[key] = deep_merge(below if merge else {}, value)  # type: ignore[arg-type]
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load`` (never the unsafe loader)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> T:
    """defaults < ``base`` (an embedded default) < file at ``path`` < ``overrides``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = deep_merge(data, read_yaml(path))
    data = deep_merge(data, parse_overrides(overrides))
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, help) for every leaf key of a schema, for ``--help-keys`` output."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))  # type: ignore[arg-type]
        else:
            rows.append((key, _type_name(tp), f.metadata.get("help", "")))
    return rows


# ------------------------------------------------------------------ pipeline schema


@dataclass
class PackConfig:
    """How token documents become fixed-length samples (ulysses_mm.data.packing)."""

    seq_len: int = _help(
        "Tokens per packed sample N; long documents continue into the next sample.", 1 << 20
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"pack.seq_len must be >= 1, got {self.seq_len}")


@dataclass
class ShardConfig:
    """WebDataset shard rollover (ulysses_mm.data.shards)."""

    max_bytes: int = _help(
        "Start a new shard when the next sample would take the tar file past this size "
        "(a single larger sample still gets a shard of its own).",
        256 << 20,
    )
    max_samples: int = _help("Also start a new shard after this many samples (0 = no limit).", 0)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError(f"shards.max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_samples < 0:
            raise ConfigError(f"shards.max_samples must be >= 0, got {self.max_samples}")


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
        "Tokenizer spec files (tokenizers/*.json), one per modality; their order is the "
        "token space's modality order.",
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
        "Local staging directory (per-input token cache, shards before upload); '' = "
        "OUTPUT.staging beside a local output, or a directory in the system temp dir named "
        "after a remote output's URL.",
        "",
    )
    keep_staging: bool = _help("Keep the staging directory after a successful run.", False)
    workers: int = _help("Tokenizer worker processes (0 = one per CPU core).", 0)
    progress: bool = _help("Show a progress bar (tqdm) on stderr.", True)

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
