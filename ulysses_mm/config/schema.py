"""The run schema (``configs/*.yaml``: a training or verification run), one dataclass per
section; each checks its own values in ``__post_init__`` (ranges, choices, combinations
inside the run config), raising :class:`ConfigError` naming the key. A numeric key
states its range once, in its ``option(...)``: ``config --keys`` prints it and
:func:`~ulysses_mm.config.parse.check_ranges` enforces it. What needs the
manifests or the world is checked by ``train.plan`` before any process starts."""

from __future__ import annotations

import dataclasses
import difflib
import signal
import typing
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ulysses_mm.config.parse import (
    SEED_MAX,
    ConfigError,
    check_ranges,
    deep_merge,
    describe,
    from_dict,
    range_of,
    to_dict,
)
from ulysses_mm.config.parse import option as _help
from ulysses_mm.core.storage import Location

WEIGHT_MAX = 1e6  # a relative weight: far below where a sum of them overflows


RopeKind = Literal["default", "linear", "dynamic", "yarn", "llama3"]
# the parameters each kind needs (transformers' ``rope_parameters`` keys); the others are
# optional or not used by the kind
ROPE_NEEDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# every parameter each kind uses (its needs and its optional ones): one set for a kind that
# uses no more is refused, so no key does nothing
ROPE_USES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ROPE_NEEDS["llama3"],
}
# model.rope.factor is how many times longer the context gets: published models use 4 to
# 40 (Llama 3.1: 8, DeepSeek V3: 40); a value past this is a typo (yarn's cos/sin scale,
# 0.1·ln(factor) + 1, is 1.7 at 1024 and 72 at 1e308)
ROPE_FACTOR_MAX = 1024.0


@dataclass
class RopeConfig:
    """Rotary positions, the kinds transformers defines (its ``rope_parameters``): the
    base θ, and how the frequencies are rescaled to reach past the length a model was
    pretrained at. ``config --from-hf`` reads them from a checkpoint; ``export`` writes
    them back, so transformers computes the same positions."""

    theta: float = _help("RoPE base frequency θ (transformers' rope_theta).", 10000.0, gt=0)
    kind: RopeKind = _help(
        "default (plain RoPE), linear (positions divided by factor), dynamic (NTK: θ raised "
        "with the longest position seen past original_max_position_embeddings), yarn "
        "(per-frequency interpolation, cos/sin scaled by attention_factor), llama3 "
        "(Llama 3.1's: low frequencies divided by factor, high ones kept, a smooth ramp "
        "between) — transformers' rope_type.",
        "default",
    )
    factor: float | None = _help(
        "Scaling factor (context growth) of linear, dynamic, yarn and llama3; below 1 it "
        "shrinks the context (a warning, as transformers gives).",
        None,
        gt=0,
        le=ROPE_FACTOR_MAX,
    )
    original_max_position_embeddings: int | None = _help(
        "The context the model was pretrained at (yarn, llama3). dynamic: the length past "
        "which θ grows (None = model.max_position_embeddings, which is what transformers "
        "reads it from: export writes it there).",
        None,
        ge=1,
    )
    attention_factor: float | None = _help(
        "yarn: scale of cos/sin (None = 0.1·ln(factor) + 1, or from mscale/mscale_all_dim).",
        None,
        gt=0,
    )
    beta_fast: float | None = _help("yarn: fast boundary of the ramp (None = 32).", None, gt=0)
    beta_slow: float | None = _help("yarn: slow boundary of the ramp (None = 1).", None, gt=0)
    mscale: float | None = _help("yarn: DeepSeek-style attention scale numerator.", None, gt=0)
    mscale_all_dim: float | None = _help(
        "yarn: DeepSeek-style attention scale denominator.", None, gt=0
    )
    truncate: bool = _help("yarn: round the correction range to whole dims.", True)
    low_freq_factor: float | None = _help(
        "llama3: low-frequency factor (Llama 3.1: 1).", None, gt=0
    )
    high_freq_factor: float | None = _help(
        "llama3: high-frequency factor (Llama 3.1: 4).", None, gt=0
    )

    def __post_init__(self) -> None:
        check_ranges("model.rope", self)
        for key in ROPE_NEEDS[self.kind]:
            if getattr(self, key) is None:
                raise ConfigError(f"model.rope.kind={self.kind} needs model.rope.{key}")
        for key in _ROPE_PARAMETERS:
            if key not in ROPE_USES[self.kind] and getattr(self, key) != _ROPE_UNSET[key]:
                raise ConfigError(
                    f"model.rope.{key} is not used by model.rope.kind={self.kind} (it uses "
                    f"{', '.join(('theta', *ROPE_USES[self.kind]))})"
                )
        if (
            self.kind == "llama3"
            and self.low_freq_factor is not None
            and self.high_freq_factor is not None
            and self.high_freq_factor <= self.low_freq_factor
        ):
            raise ConfigError(
                f"model.rope.high_freq_factor ({self.high_freq_factor}) must be above "
                f"model.rope.low_freq_factor ({self.low_freq_factor})"
            )
        if self.factor is not None and self.factor < 1:
            warnings.warn(
                f"model.rope.factor={self.factor:g} is below 1: the {self.kind} RoPE shrinks "
                "the context instead of extending it (transformers warns of it too)",
                UserWarning,
                stacklevel=2,
            )

    def original_length(self, max_position_embeddings: int) -> int | None:
        """The length the scaling reaches past: ``original_max_position_embeddings``, for
        dynamic defaulting to the model's ``max_position_embeddings`` (None for default and
        linear, which have none)."""
        if self.kind == "dynamic":
            return self.original_max_position_embeddings or max_position_embeddings
        return self.original_max_position_embeddings

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' ``rope_parameters`` (5.x): ``rope_type``, ``rope_theta`` and the
        kind's set keys. dynamic's original length is not among them: transformers reads it
        from ``max_position_embeddings`` (:meth:`ModelConfig.to_llama_config_kwargs`)."""
        keys = [k for k in ROPE_USES[self.kind] if getattr(self, k) != _ROPE_UNSET[k]]
        if self.kind == "dynamic":
            keys = [k for k in keys if k != "original_max_position_embeddings"]
        return {"rope_type": self.kind, "rope_theta": self.theta} | {
            k: getattr(self, k) for k in keys
        }


# the scaling parameters (every RopeConfig field but theta and kind), and their unset value
_ROPE_PARAMETERS = tuple(k for k in RopeConfig.__dataclass_fields__ if k not in ("theta", "kind"))
_ROPE_UNSET: dict[str, Any] = {k: None for k in _ROPE_PARAMETERS} | {"truncate": True}


@dataclass
class ModelConfig:
    """A Llama-style decoder. The architecture fields map one-to-one onto
    ``transformers.LlamaConfig`` (see :meth:`to_llama_config_kwargs`); ``qk_norm`` makes it
    a Qwen3, ``attention_bias`` a Qwen2."""

    hidden_size: int = _help("Model width D (LlamaConfig.hidden_size).", 64, ge=1)
    intermediate_size: int = _help("SwiGLU inner width (LlamaConfig.intermediate_size).", 172, ge=1)
    num_hidden_layers: int = _help("Decoder layers.", 2, ge=1)
    num_attention_heads: int = _help("Query heads H.", 4, ge=1)
    num_key_value_heads: int = _help(
        "Key/value heads (GQA/MQA when < num_attention_heads).", 4, ge=1
    )
    head_dim: int | None = _help(
        "Per-head width; defaults to hidden_size / num_attention_heads.", None, ge=1
    )
    rms_norm_eps: float = _help("RMSNorm epsilon.", 1e-5, gt=0)
    rope: RopeConfig = _help("Rotary positions: θ and their scaling.", factory=RopeConfig)
    max_position_embeddings: int = _help(
        "Longest position id the model is meant for (positions restart per document).",
        1 << 20,
        ge=1,
    )
    initializer_range: float = _help(
        "Std of the normal init of linear and embedding weights.", 0.02, ge=0
    )
    embedding_init_std: float = _help(
        "Std of the normal init of the token embedding (0 = initializer_range, as "
        "transformers; torchtitan's Llama uses 1.0, which small models learn in-context "
        "retrieval with far sooner).",
        0.0,
        ge=0,
    )
    modalities: dict[str, int] = _help(
        "Vocabulary size per modality, in token-space order. Empty: take it from the data "
        "manifest at training time.",
        factory=dict,
        ge=1,
    )
    loss_weights: dict[str, float] = _help(
        "Per-modality loss weight (missing modalities weigh 1.0). The total loss is the "
        "weighted mean of the per-modality token-mean losses present in the global batch.",
        factory=dict,
        ge=0,
        le=WEIGHT_MAX,
    )
    loss_tile_tokens: int = _help(
        "Tokens per loss tile: [tile, vocab] logits are the most ever materialised.", 8192, ge=1
    )
    mlp_tile_tokens: int = _help(
        "Tokens per MLP tile, each recomputed in backward (0 = no MLP tiling; refused with "
        "layer_tile_tokens, whose tiles hold the MLP already).",
        0,
        ge=0,
    )
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
        ge=0,
    )

    def __post_init__(self) -> None:
        if isinstance(self.rope, Mapping):  # ModelConfig(rope={...}), as hf_import gives it
            self.rope = from_dict(RopeConfig, self.rope, "model.rope")
        check_ranges("model", self)
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
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise ConfigError(
                "model.offload_checkpoints needs model.activation_checkpointing=true "
                "(it moves the checkpointed layer inputs to the host)"
            )
        # memory options that would do nothing are refused, never ignored
        if self.offload_checkpoints and self.num_hidden_layers == 1:
            raise ConfigError(
                "model.offload_checkpoints does nothing with model.num_hidden_layers=1 (the last "
                "layer's input stays on the device); set model.offload_checkpoints=false"
            )
        if self.mlp_tile_tokens and self.layer_tile_tokens:
            raise ConfigError(
                "model.mlp_tile_tokens does nothing under model.layer_tile_tokens (layer tiles "
                "already run the MLP tile by tile); set model.mlp_tile_tokens=0"
            )

    def to_llama_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the equivalent ``transformers.LlamaConfig`` (backbone only).
        Its ``max_position_embeddings`` is, for the dynamic RoPE, that kind's original length
        (transformers scales θ past ``max_position_embeddings``)."""
        max_positions = self.max_position_embeddings
        if self.rope.kind == "dynamic":
            max_positions = self.rope.original_length(max_positions) or max_positions
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope.rope_parameters(),
            max_position_embeddings=max_positions,
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
    are consecutive, so on GPUs they share a node). The run's
    :class:`~ulysses_mm.core.layout.Layout` is built from it once the world is known."""

    RENAMED: ClassVar[dict[str, str]] = {"head_chunks": "head_groups"}  # old key: new key

    sp: int = _help(
        "Sequence-parallel size: the ranks that split one sample's sequence, U × R (the "
        "Ulysses all-to-all group of U = sp / ring ranks times the ring of R = ring).",
        1,
        ge=1,
    )
    dp: int = _help("Data-parallel size D; 0 = world_size / sp.", 0, ge=0)
    ring: int = _help(
        "Ring size R inside each SP group (hybrid Ulysses × ring): sp = U × R, Ulysses over "
        "U = sp / R consecutive ranks, ring attention across the R groups; U must divide the "
        "heads and 2·sp the sequence. 1 = pure Ulysses; R = sp = pure ring.",
        1,
        ge=1,
    )
    head_groups: int = _help(
        "Attention in C groups of heads: the q/k/v all-to-all and the local kernel run for "
        "H/(U·C) query heads at a time, recomputed per group in backward, so one group's "
        "q/k/v and working set are alive instead of all heads'. C must divide each rank's "
        "query heads (and split or share its kv heads). 1 = all heads at once.",
        1,
        ge=1,
    )
    backend: Literal["auto", "gloo", "nccl"] = _help(
        "torch.distributed backend; auto = nccl when every local rank has its own GPU, else gloo.",
        "auto",
    )
    attention: AttentionKernel = _help(
        "Local attention kernel run on H/U heads (U = sp / ring): auto = flash_varlen on a "
        "GPU in bf16/fp16 when flash-attn loads, else sdpa_varlen; flash_varlen in fp32 is "
        "refused.",
        "auto",
    )
    timeout_s: int = _help("Collective timeout in seconds (a hang becomes an error).", 600, ge=1)

    def __post_init__(self) -> None:
        check_ranges("parallel", self)
        if self.sp % self.ring:
            raise ConfigError(
                f"parallel.ring must be >= 1 and divide parallel.sp={self.sp}, got {self.ring}"
            )


@dataclass
class TrainSource:
    """One manifest of a mix given as a mapping: ``{weight: 1.0, modalities: {video: 0.5,
    audio: 0.3, dna: 0.2}}``."""

    weight: float = _help(
        "The manifest's share of the samples (against the others').", 1.0, gt=0, le=WEIGHT_MAX
    )
    modalities: dict[str, float] = _help(
        "Weights of the modalities inside the manifest: each gets its weight's share of the "
        "manifest's tokens (the samples a modality not named here dominates are left out; "
        "{} = the manifest as it comes).",
        factory=dict,
        gt=0,
        le=WEIGHT_MAX,
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
    seq_len: int = _help("Tokens per sample N; 0 = the manifest's seq_len.", 0, ge=0)
    micro_batch_size: int = _help("Samples per DP rank per micro-step.", 1, ge=1)
    window_positions: Literal["restart", "continue"] = _help(
        "When seq_len is shorter than the manifest's samples, which are then cut into "
        "windows: where a window cuts a document, its positions restart at 0 (a stage at "
        "seq_len trains positions below seq_len only, the length it is said to train at) "
        "or continue the document's (positions reach the document's length).",
        "restart",
    )
    balance: bool = _help(
        "Balanced steps: with dp > 1, spread each optimizer step's samples over DP ranks "
        "and micro-steps by their attention work (Σ l·(l+1)/2 over their documents, from "
        "the manifest's sample_pairs), so no rank waits long for another; the same samples "
        "in each step and the same loss. Off: rank r reads positions [r·mb, (r+1)·mb) of "
        "each micro-step. Not with windows (data.seq_len shorter than the samples).",
        True,
    )
    seed: int = _help(
        "Seed of the sample order (a function of seed, epoch, manifest).", 0, ge=0, le=SEED_MAX
    )
    shuffle: bool = _help("Shuffle shards and samples each epoch.", True)
    shuffle_buffer: int = _help(
        "Shuffle buffer: each sample moves by fewer than this many positions, which blends "
        "the seams between shards (capped at half the smallest shard; 0 = off).",
        16,
        ge=0,
    )
    retries: int = _help("Attempts to open a shard URL before giving up.", 5, ge=0)
    retry_backoff_s: float = _help("First retry delay; doubled each attempt.", 0.5, ge=0)
    connect_timeout_s: float = _help("Seconds to wait for a storage server to connect.", 10.0, gt=0)
    read_timeout_s: float = _help(
        "Seconds of silence from a storage server before a read is retried.", 60.0, gt=0
    )
    prefetch_bytes: int = _help(
        "Bytes of upcoming shards fetched on a background thread (0 = fetch in the step).",
        1 << 30,
        ge=0,
    )
    cache_dir: str = _help(
        "Node-local directory the ranks of a node share, so each shard is downloaded once "
        "per node ('' = no cache).",
        "",
    )
    cache_bytes: int = _help(
        "Most bytes cache_dir holds; least recently used shards are removed.", 64 << 30, ge=0
    )
    storage_options: dict[str, Any] = _help(
        "fsspec storage options (for example endpoint_url for an S3-API server).", factory=dict
    )
    max_manifest_bytes: int = _help(
        "Largest manifest body read; a bigger one is refused before it is read.", 256 << 20, ge=1
    )

    def __post_init__(self) -> None:
        for key in ("connect_timeout_s", "read_timeout_s"):
            value = getattr(self, key)
            if not range_of(DataConfig, key).contains(value):
                raise ConfigError(f"data.{key}={value}: give a positive number of seconds")
        check_ranges("data", self)
        mix = {} if isinstance(self.train, str) else self.train
        weight, mod_weight = range_of(TrainSource, "weight"), range_of(TrainSource, "modalities")
        for location, value in mix.items():
            source = value if isinstance(value, TrainSource) else TrainSource(weight=value)
            if not weight.contains(source.weight):
                raise ConfigError(
                    f"data.train: the weight of {location} is {source.weight}; give a positive "
                    f"one, within {weight}"
                )
            for name, w in source.modalities.items():
                if not mod_weight.contains(w):
                    raise ConfigError(
                        f"data.train: {location}: the weight of {name} is {w}; give a positive "
                        f"one, within {mod_weight}"
                    )

    @property
    def timeouts(self) -> tuple[float, float]:
        """(connect, read) seconds of every remote read, manifests and shards alike."""
        return self.connect_timeout_s, self.read_timeout_s

    def location(self, url: str) -> Location:
        """``url`` (a manifest, a dataset) as the data is reached: storage_options and the
        read timeouts."""
        return Location(url, self.storage_options, self.timeouts)


@dataclass
class OptimizerConfig:
    type: Literal["AdamW", "Adam", "SGD"] = _help("DeepSpeed optimizer type.", "AdamW")
    lr: float = _help("Peak learning rate.", 3e-4, ge=0)
    betas: list[float] = _help("Adam betas.", factory=lambda: [0.9, 0.95], ge=0, lt=1)
    eps: float = _help("Adam epsilon.", 1e-8, gt=0)
    weight_decay: float = _help("Decoupled weight decay.", 0.1, ge=0)
    torch_adam: bool = _help(
        "Use torch's Adam inside DeepSpeed (no JIT-compiled C++/CUDA op).", True
    )

    def __post_init__(self) -> None:
        betas = range_of(OptimizerConfig, "betas")
        if len(self.betas) != 2 or not all(betas.contains(b) for b in self.betas):
            raise ConfigError(
                f"deepspeed.optimizer.betas must be two numbers in {betas}, got {self.betas}"
            )
        check_ranges("deepspeed.optimizer", self)


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
        ge=0,
    )
    min_lr_ratio: float = _help("Final LR as a fraction of the peak (cosine).", 0.1, ge=0, le=1)

    def __post_init__(self) -> None:
        check_ranges("deepspeed.scheduler", self)


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed engine. ``extra`` is merged last into the generated ds_config for
    options this schema does not name."""

    zero_stage: Literal[0, 1, 2, 3] = _help("ZeRO stage.", 0)
    precision: Literal["fp32", "bf16", "fp16"] = _help("Training precision.", "fp32")
    gradient_accumulation_steps: int = _help("Micro-steps per optimizer step.", 1, ge=1)
    gradient_clipping: float = _help("Clip the global grad norm to this (0 = off).", 1.0, ge=0)
    offload_optimizer: Literal["none", "cpu"] = _help("ZeRO optimizer-state offload.", "none")
    offload_param: Literal["none", "cpu"] = _help("ZeRO-3 parameter offload.", "none")
    optimizer: OptimizerConfig = _help("Optimizer.", factory=OptimizerConfig)
    scheduler: SchedulerConfig = _help("LR schedule.", factory=SchedulerConfig)
    extra: dict[str, Any] = _help("Raw ds_config entries merged last.", factory=dict)

    def __post_init__(self) -> None:
        check_ranges("deepspeed", self)
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ConfigError("deepspeed.offload_param needs deepspeed.zero_stage=3")
        if "scheduler" in self.extra and self.scheduler.type != "none":
            raise ConfigError(
                f"deepspeed.extra.scheduler and deepspeed.scheduler.type={self.scheduler.type} "
                "both set the LR schedule; set deepspeed.scheduler.type=none to use DeepSpeed's"
            )


# What a stage may set (train.stages[i]): each entry a key, or a section whose every key a
# stage may set. One line here makes a key stage-settable; the value is checked by the
# schema like any other, on the stage's whole run config (RunConfig.stage_configs).
STAGE_KEYS = (
    "data.seq_len",
    "data.micro_batch_size",
    "data.window_positions",
    "model.rope",  # another kind starts from its own defaults, θ kept
    "parallel.sp",
    "parallel.ring",
    "parallel.head_groups",
)


def _stage_key_allowed(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in STAGE_KEYS)


def _allowed_text() -> str:
    return ", ".join(k + ".*" if k == "model.rope" else k for k in STAGE_KEYS)


@dataclass
class StageConfig:
    """A stage's own keys (the rest of a stage are the dotted keys it sets, over the stage
    before's: :data:`STAGE_KEYS`)."""

    steps: int = _help("Optimizer steps of this stage.", 1, ge=1)
    warmup_steps: int = _help(
        "Linear re-warm-up over the stage's first steps: the run's lr times k/W at its "
        "step k <= W (0 = none; at most the stage's steps).",
        0,
        ge=0,
    )


def _dotted(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of a mapping as (dotted key, value): ``{data: {seq_len: 4}}`` and
    ``{data.seq_len: 4}`` both give ``("data.seq_len", 4)``."""
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def stage_overrides(i: int, stage: Any) -> dict[str, Any]:
    """``train.stages[i]`` as the flat mapping the run keeps: ``steps``, ``warmup_steps``
    and the dotted keys it sets (given nested, ``data: {seq_len: 512}``, or dotted,
    ``data.seq_len: 512``). A key :data:`STAGE_KEYS` does not allow, a key given twice or
    a warm-up longer than the stage is one line naming the stage."""
    where = f"train.stages[{i}]"
    if not isinstance(stage, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping (steps: N and the keys it sets), got {stage!r}"
        )
    own = {k: stage[k] for k in StageConfig.__dataclass_fields__ if k in stage}
    if "steps" not in own:
        raise ConfigError(f"{where}: give its steps (steps: N)")
    spec = from_dict(StageConfig, own, where)
    check_ranges(where, spec)
    if spec.warmup_steps > spec.steps:
        raise ConfigError(
            f"{where}.warmup_steps={spec.warmup_steps} is longer than the stage "
            f"(steps: {spec.steps}); give at most {spec.steps}"
        )
    out: dict[str, Any] = {"steps": spec.steps, "warmup_steps": spec.warmup_steps}
    rest = {k: v for k, v in stage.items() if k not in own}
    for given, value in _dotted(rest):
        key = _current_name(given)
        if key != given:  # an old name still read, as in a run config, with a hint
            warnings.warn(
                f"'{where}.{given}' is now '{where}.{key}'; rename it in the config",
                FutureWarning,
                stacklevel=2,
            )
        if not _stage_key_allowed(key):
            # a key the run does not have is a typo: the closest stage key is offered
            typo = key not in {row[0] for row in describe(RunConfig)}
            near = difflib.get_close_matches(key, STAGE_KEYS, n=1) if typo else []
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"{where}: {key} is not a key a stage may set{hint}; a stage sets steps, "
                f"warmup_steps and {_allowed_text()}"
            )
        if key in out:
            raise ConfigError(f"{where}: {key} is given twice (nested and dotted); give it once")
        if value is not None:  # null: the stage before's, as a key left out
            out[key] = value
    return out


def _current_name(key: str) -> str:
    """``key`` with a field's old name (its section's ``RENAMED``) replaced by the new one."""
    parts = key.split(".")
    section: Any = RunConfig
    for n, name in enumerate(parts):
        if not dataclasses.is_dataclass(section):
            break
        parts[n] = name = getattr(section, "RENAMED", {}).get(name, name)
        section = typing.get_type_hints(section).get(name)
    return ".".join(parts)


def _nested(dotted: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``{"data.seq_len": 4}`` as ``{"data": {"seq_len": 4}}``."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *sections, leaf = key.split(".")
        node = out
        for n, name in enumerate(sections):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                above = ".".join(sections[: n + 1])
                raise ConfigError(f"{where}: {above} and {key} both set {above}; give one")
        if isinstance(node.get(leaf), dict):
            raise ConfigError(f"{where}: {key} and keys under it both set {key}; give one")
        node[leaf] = value
    return out


@dataclass
class TrainConfig:
    steps: int = _help("Optimizer steps to run.", 100, ge=1)
    seed: int = _help("Seed of model initialisation.", 0, ge=0, le=SEED_MAX)
    out_dir: str = _help("Run directory: metrics, checkpoints, plots.", "runs/debug")
    log_every: int = _help("Log metrics every K steps.", 1, ge=1)
    eval_every: int = _help("Evaluate every K steps (0 = never).", 0, ge=0)
    eval_batches: int = _help("Micro-batches per evaluation.", 4, ge=1)
    checkpoint_every: int = _help("Save a checkpoint every K steps (0 = only at the end).", 0, ge=0)
    keep_checkpoints: int = _help(
        "Checkpoints kept on disk (oldest removed first; 0 = all).", 3, ge=0
    )
    peak_tflops: float = _help(
        "Peak device TFLOP/s for the MFU estimate (0 = the figure of a known GPU at "
        "deepspeed.precision; no MFU is logged on other devices).",
        0.0,
        ge=0,
    )

    gpu_mem_gib: float = _help(
        "Memory of one GPU in GiB: before any process starts, every stage must fit it as "
        "`ulysses-mm estimate` computes (0 = no check).",
        0.0,
        ge=0,
    )
    stages: list[dict[str, Any]] = _help(
        "Stages that grow the context within the run, in order, each its steps, "
        "warmup_steps (a re-warm-up, at most its steps) and the keys it sets over the stage "
        f"before's, nested or dotted: {_allowed_text()}; their steps add up to train.steps "
        "([] = one stage: the run as configured).",
        factory=list,
    )
    resume: Literal["auto", "always", "never", "restart"] = _help(
        "auto: continue from the run directory's latest complete checkpoint when it has "
        "one, else start fresh (a requeued job reruns the same command); always: a "
        "checkpoint must be there (what --resume sets); never: start fresh, refused when "
        "the run directory holds a run; restart: start fresh after moving the run "
        "directory's run to RUN_DIR/previous/<time>/ (nothing is deleted).",
        "auto",
    )
    max_minutes: float = _help(
        "Time budget in minutes from the command's start (0 = none): the run stops with "
        "a checkpoint (exit 75) when the next step and a save would not fit in what is left.",
        0.0,
        ge=0,
    )
    stop_signals: list[str] = _help(
        "Signals that stop the run at the next step boundary with a checkpoint (exit 75); "
        "a second one more than 2 s later ends it at once.",
        factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"],
    )
    stop_grace_s: int = _help(
        "Seconds the --nproc launcher waits for its ranks to save and leave after it "
        "forwarded a signal, before it kills them.",
        600,
        ge=1,
    )
    async_save: bool = _help(
        "Write checkpoints on a background thread: a save stops training only while the "
        "state is copied to host memory.",
        True,
    )
    save_writer: Literal["thread", "process"] = _help(
        "What serializes a background save: a thread of the rank (it shares the GIL with "
        "training), or a writer process fed through shared memory (needs /dev/shm room "
        "for twice a rank's state). benchmarks/bench_async_save.py measures both.",
        "thread",
    )
    save_timeout_s: float = _help(
        "A checkpoint still being written after this many seconds fails the run (a "
        "stalled file system or object store).",
        1800.0,
        gt=0,
    )
    checkpoint_dir: str = _help(
        "Where checkpoints go ('' = RUN_DIR/checkpoints); an fsspec URL such as "
        "s3://bucket/prefix for clusters without a shared file system (each rank writes "
        "locally and uploads in the background; latest is written last).",
        "",
    )

    def __post_init__(self) -> None:
        check_ranges("train", self)
        for name in self.stop_signals:
            if not isinstance(name, str) or not isinstance(
                getattr(signal, name, None), signal.Signals
            ):
                raise ConfigError(
                    f"train.stop_signals: {name!r} is not a signal name (SIGTERM, SIGINT, "
                    "SIGUSR1, SIGUSR2, SIGHUP, ...)"
                )
            if name in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(f"train.stop_signals: {name} cannot be caught")
        self.stages = [stage_overrides(i, stage) for i, stage in enumerate(self.stages)]
        if self.stages and sum(s["steps"] for s in self.stages) != self.steps:
            steps = " + ".join(str(s["steps"]) for s in self.stages)
            raise ConfigError(
                f"train.stages: their steps add up to {steps} = "
                f"{sum(s['steps'] for s in self.stages)}, but train.steps={self.steps}; "
                "make them equal"
            )


@dataclass
class LoggingConfig:
    wandb: Literal["auto", "online", "offline", "disabled"] = _help(
        "W&B mode; auto = online when an API key is set, else offline.", "auto"
    )
    project: str = _help("W&B project.", "ulysses-mm")
    run_name: str = _help("W&B run name ('' = generated).", "")
    jsonl: bool = _help("Also append every logged step to RUN_DIR/metrics.jsonl.", True)
    samples: bool = _help(
        "At each evaluation (train.eval_every), rank 0 generates one document per modality "
        "from the model as it is (logging.sample_tokens ids from <doc> <|m|>, temperature 1, "
        "seed train.seed), writes it under RUN_DIR/samples/ and logs it to W&B as audio, "
        "video or text. Needs deepspeed.zero_stage below 3.",
        False,
    )
    sample_tokens: int = _help("Ids generated per modality for logging.samples.", 2048, ge=1)

    def __post_init__(self) -> None:
        check_ranges("logging", self)


@dataclass
class RunConfig:
    """A training or verification run (``configs/*.yaml``)."""

    model: ModelConfig = _help("Backbone and heads.", factory=ModelConfig)
    parallel: ParallelConfig = _help("Process layout.", factory=ParallelConfig)
    data: DataConfig = _help("Training data.", factory=DataConfig)
    deepspeed: DeepSpeedConfig = _help("DeepSpeed engine.", factory=DeepSpeedConfig)
    train: TrainConfig = _help("Loop, checkpoints, evaluation.", factory=TrainConfig)
    logging: LoggingConfig = _help("Metrics sinks.", factory=LoggingConfig)

    def __post_init__(self) -> None:
        if self.train.stages:  # each stage is a whole run config: checked here, named
            self.stage_configs()

    def stage_configs(self) -> list[RunConfig]:
        """Each stage's whole run config (its ``train.stages`` empty): the stage's keys over
        the stage before's config (the first's over this one), built and checked by the
        schema like any run config; a bad one raises one line naming the stage
        (``train.stages[1]: model.rope.kind=yarn needs …``). [] without stages."""
        if not self.train.stages:
            return []
        base = to_dict(self)
        base["train"]["stages"] = []
        out = []
        for i, stage in enumerate(self.train.stages):
            where = f"train.stages[{i}]"
            keys = {k: v for k, v in stage.items() if "." in k}
            kind = keys.get("model.rope.kind")
            if kind is not None and kind != base["model"]["rope"]["kind"]:
                # another kind starts from its own defaults: the keys of the kind before go
                # (a kind refuses keys it does not use), θ stays unless the stage sets it
                base["model"]["rope"] = {"theta": base["model"]["rope"]["theta"]}
            base = deep_merge(base, _nested(keys, where))
            try:
                out.append(from_dict(RunConfig, base))
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        return out
