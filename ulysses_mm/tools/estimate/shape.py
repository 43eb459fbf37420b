"""What an estimate is for: the model's dimensions, the token space, and the step's sizes.

:class:`StepShape` is the process layout a :class:`~ulysses_mm.parallel.mesh.Mesh` would
have (its :class:`~ulysses_mm.core.layout.Layout`), with the batch one rank holds: the
estimate needs no ranks or groups, only how many tokens and heads each rank gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.config import RunConfig
from ulysses_mm.core.layout import Layout, LayoutError, expanded_kv_heads
from ulysses_mm.core.storage import Location
from ulysses_mm.core.tokenspace import DEFAULT_MODALITIES, TokenSpace
from ulysses_mm.shards.manifest import Manifest


@dataclass(frozen=True)
class ModelShape:
    """Dimensions and parameter counts of :class:`ulysses_mm.model.MultimodalLM`."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    specials: int
    vocab: int  # the whole token space: embedding rows, and all heads' rows together
    widest_head: int  # specials + the largest modality vocabulary
    qk_norm: bool = False  # q/k RMSNorm weights, head_dim each (Qwen3)
    attention_bias: bool = False  # q/k/v biases (Qwen2)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_expanded(self, ulysses: int) -> int:
        """kv heads after Ulysses replication over ``ulysses`` ranks (see parallel.ulysses)."""
        return expanded_kv_heads(self.heads, self.kv_heads, ulysses)

    def _layer_tensors(self) -> list[int]:
        d, q, k, i = self.hidden, self.q_width, self.kv_width, self.inter
        extra = [self.head_dim, self.head_dim] if self.qk_norm else []
        extra += [q, k, k] if self.attention_bias else []
        return [d * q, d * k, d * k, q * d, d * i, d * i, i * d, d, d, *extra]

    @property
    def layer_params(self) -> int:
        return sum(self._layer_tensors())

    @property
    def head_params(self) -> int:
        """Every modality head + the shared specials head + the final norm."""
        return self.vocab * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.vocab * self.hidden + self.layers * self.layer_params + self.head_params

    @property
    def largest_param(self) -> int:
        return max([self.vocab * self.hidden, *self._layer_tensors()])

    def small_params(self, threshold: int, modality_sizes: list[int]) -> int:
        """Parameters in tensors of at most ``threshold`` elements (ZeRO-3 keeps those
        whole on every rank: stage3_param_persistence_threshold)."""
        sizes = [self.vocab * self.hidden, self.hidden, self.specials * self.hidden]
        sizes += [v * self.hidden for v in modality_sizes]
        small = sum(s for s in sizes if s <= threshold)
        return small + self.layers * sum(s for s in self._layer_tensors() if s <= threshold)


def model_shape(cfg: RunConfig, space: TokenSpace) -> ModelShape:
    m = cfg.model
    assert m.head_dim is not None
    return ModelShape(
        hidden=m.hidden_size,
        inter=m.intermediate_size,
        layers=m.num_hidden_layers,
        heads=m.num_attention_heads,
        kv_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        specials=space.num_specials,
        vocab=space.vocab_size,
        widest_head=space.num_specials + max(r.size for r in space.ranges),
        qk_norm=m.qk_norm,
        attention_bias=m.attention_bias,
    )


def token_space(cfg: RunConfig, manifest: str | None = None) -> tuple[TokenSpace, str]:
    """The token space the run trains on and where it comes from: ``model.modalities``,
    else the manifest given, else the shipped tokenizer specs' space."""
    if cfg.model.modalities:
        return TokenSpace.from_vocab(cfg.model.modalities), "model.modalities"
    if manifest:
        where = Location(manifest, cfg.data.storage_options)
        return Manifest.load(where).token_space, manifest
    return TokenSpace.from_vocab(DEFAULT_MODALITIES), "the shipped tokenizer specs"


@dataclass(frozen=True)
class StepShape:
    """The sizes of one training step: the :class:`~ulysses_mm.core.layout.Layout` of a
    :class:`~ulysses_mm.parallel.mesh.Mesh` (its world of dp × sp ranks, sp = U × R, in C
    head groups), each rank holding ``micro_batch`` samples' N/sp tokens of ``seq_len`` = N."""

    layout: Layout
    seq_len: int
    micro_batch: int

    @property
    def gpus(self) -> int:
        return self.layout.world_size

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ring_size(self) -> int:
        """R: sp = U × R, Ulysses over U ranks, ring attention across R groups."""
        return self.layout.ring_size

    @property
    def ulysses_size(self) -> int:
        """U = sp / R: the ranks of one all-to-all."""
        return self.layout.ulysses_size

    @property
    def head_groups(self) -> int:
        """C: attention in C groups of heads (parallel.head_groups)."""
        return self.layout.head_groups

    @property
    def tokens(self) -> int:
        """T: the tokens one rank holds outside attention, b · N/sp."""
        return self.micro_batch * (self.seq_len // self.sp)

    @property
    def full_tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def communicators(self) -> int:
        """NCCL communicators one rank is in: the world and its SP and DP groups, each
        when it has more than one rank, and with a ring its Ulysses group (U > 1) and its
        ring (ulysses_mm.parallel.Mesh.build)."""
        groups = [self.gpus, self.sp, self.dp]
        if self.ring_size > 1:
            groups += [self.ulysses_size, self.ring_size]
        return sum(n > 1 for n in groups)

    def to_dict(self) -> dict[str, int]:
        """The step's sizes as the estimate's JSON gives them (``layout``)."""
        lay = self.layout
        return {
            "gpus": self.gpus,
            "sp": lay.sp,
            "dp": lay.dp,
            "ring_size": lay.ring_size,
            "ulysses_size": lay.ulysses_size,
            "head_groups": lay.head_groups,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "tokens": self.tokens,
        }


def gpus_and_sp(cfg: RunConfig, gpus: int | None, sp: int | None) -> tuple[int, int]:
    """(gpus, sp): ``gpus`` defaults to parallel.sp × parallel.dp; ``sp`` to ``gpus`` when
    gpus is given (the longest context puts every GPU in one sequence-parallel group),
    else to parallel.sp."""
    p = cfg.parallel
    if gpus is None:
        sp = sp or p.sp
        gpus = sp * (p.dp or 1)
    elif sp is None:
        sp = gpus
    return gpus, sp


def step_shape(
    cfg: RunConfig,
    seq_len: int,
    gpus: int | None,
    sp: int | None,
    head_groups: int | None = None,
) -> StepShape:
    """The step of ``gpus`` and ``sp`` (defaults: :func:`gpus_and_sp`). The ring is
    parallel.ring (sp = U × R), the head groups parallel.head_groups unless given. Shapes
    Ulysses × ring (× head groups) cannot run are refused with what would work."""
    p = cfg.parallel
    gpus, sp = gpus_and_sp(cfg, gpus, sp)
    if gpus < 1:
        raise LayoutError(f"need at least one GPU, got {gpus}")
    m = cfg.model
    layout = Layout.resolve(
        gpus,
        sp,
        ring_size=p.ring,
        head_groups=head_groups or p.head_groups,
        num_heads=m.num_attention_heads,
        num_kv_heads=m.num_key_value_heads,
        seq_len=seq_len,
    )
    return StepShape(layout, seq_len=seq_len, micro_batch=cfg.data.micro_batch_size)
