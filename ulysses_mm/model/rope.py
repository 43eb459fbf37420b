"""Rotary positions: the frequencies of each kind transformers defines, and the module
that turns position ids into cos/sin.

:func:`rope_frequencies` computes ``inv_freq`` (fp32) and the cos/sin scale of a
:class:`~ulysses_mm.config.RopeConfig` with transformers' own arithmetic
(``modeling_rope_utils._compute_*_parameters``, operation for operation, dtypes included),
so a model imported from or exported to transformers rotates by the same fp32
frequencies. :class:`RotaryEmbedding` evaluates the angles in fp64 (see its docstring),
and holds the one piece of state a kind has: dynamic NTK's θ, grown with the longest
position seen, as transformers' ``dynamic_rope_update`` grows it.

Dims: b batch, n positions held by this process, d head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ulysses_mm.config import RopeConfig

Device = torch.device | str | None
# (rope, head_dim, original length, device, seq_len) -> (inv_freq [d/2] fp32, cos/sin scale)
Frequencies = Callable[[RopeConfig, int, int, Device, "Tensor | int | None"], tuple[Tensor, float]]


def _base_inv_freq(theta: float, dim: int, device: Device) -> Tensor:
    # [d/2] fp32: transformers' ``1 / base ** (arange(0, dim, 2).float() / dim)``
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (theta ** (exponents / dim))


def _default(
    rope: RopeConfig, dim: int, original: int, device: Device, seq_len: Tensor | int | None
) -> tuple[Tensor, float]:
    return _base_inv_freq(rope.theta, dim, device), 1.0


def _linear(
    rope: RopeConfig, dim: int, original: int, device: Device, seq_len: Tensor | int | None
) -> tuple[Tensor, float]:
    """Positions divided by ``factor`` (applied to the frequencies: the same angles)."""
    assert rope.factor is not None
    inv_freq = _base_inv_freq(rope.theta, dim, device)
    inv_freq /= rope.factor
    return inv_freq, 1.0


def _dynamic(
    rope: RopeConfig, dim: int, original: int, device: Device, seq_len: Tensor | int | None
) -> tuple[Tensor, float]:
    """NTK: θ raised so that ``seq_len`` positions fit where ``original`` did. A tensor
    ``seq_len`` (the forward's, as transformers passes it) makes θ an fp32 tensor; an int
    or None (construction) a Python float — transformers' two roundings, both kept."""
    assert rope.factor is not None
    factor, base = rope.factor, rope.theta
    length: Tensor | int
    if seq_len is None:
        length = original
    elif isinstance(seq_len, Tensor):
        length = torch.maximum(
            seq_len, torch.tensor(original, dtype=seq_len.dtype, device=seq_len.device)
        )
    else:
        length = max(seq_len, original)
    theta = base * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (theta ** (exponents / dim)), 1.0


def _yarn_scale(scale: float, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    rope: RopeConfig, dim: int, original: int, device: Device, seq_len: Tensor | int | None
) -> tuple[Tensor, float]:
    """YaRN: each frequency between extrapolated (kept) and interpolated (divided by
    ``factor``), by a linear ramp over the dims whose wavelength is between
    ``beta_fast`` and ``beta_slow`` rotations of the original context; cos/sin scaled
    by ``attention_factor``."""
    assert rope.factor is not None
    base, factor = rope.theta, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(
                _yarn_scale(factor, rope.mscale) / _yarn_scale(factor, rope.mscale_all_dim)
            )
        else:
            attention_factor = _yarn_scale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength makes ``rotations`` turns over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low: float = correction_dim(beta_fast)
    high: float = correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation = 1 - ramp.to(device=device, dtype=torch.float)  # [d/2]
    inv_freq = inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
    return inv_freq, attention_factor


def _llama3(
    rope: RopeConfig, dim: int, original: int, device: Device, seq_len: Tensor | int | None
) -> tuple[Tensor, float]:
    """Llama 3.1: wavelengths longer than original/low_freq_factor divided by ``factor``,
    shorter than original/high_freq_factor kept, a smooth ramp between."""
    assert rope.factor is not None
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    factor, low_ff, high_ff = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    inv_freq = _base_inv_freq(rope.theta, dim, device)
    low_freq_wavelen = original / low_ff
    high_freq_wavelen = original / high_ff
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


FREQUENCIES: dict[str, Frequencies] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
}


def rope_frequencies(
    rope: RopeConfig,
    head_dim: int,
    max_position_embeddings: int,
    seq_len: Tensor | int | None = None,
    device: Device = None,
) -> tuple[Tensor, float]:
    """``inv_freq`` [head_dim/2] (fp32) and the cos/sin scale of ``rope``, as
    transformers computes them for a model of ``head_dim`` and ``max_position_embeddings``;
    ``seq_len``: the length dynamic NTK is computed for (None: its original length)."""
    original = rope.original_length(max_position_embeddings) or max_position_embeddings
    return FREQUENCIES[rope.kind](rope, head_dim, original, device, seq_len)


class RotaryEmbedding(nn.Module):
    """RoPE as in Llama (rotate-half layout); positions come from the packed sample, so
    they restart at every document — but a document may be millions of tokens long.

    The angles are computed in fp64 and reduced mod 2π before the fp32 cos/sin, so their
    precision does not depend on the absolute position (in fp32 the angle of position 2^20
    is off by up to 0.03 rad, and past 2^24 neighbouring positions get the same angle). The
    frequencies are transformers' fp32 ones (:func:`rope_frequencies`), so an exported
    model computes the same logits at every position where fp32 angles are exact.
    ``inv_freq`` stays fp32 even where an engine casts buffers to bf16: it is restored at
    use from a copy no module cast reaches.

    The dynamic kind is stateful, as transformers' is: a forward whose longest position
    (``max(position_ids) + 1``) passes the longest seen so far recomputes θ for it; one
    back below the original length restores the original frequencies. Under sequence
    parallelism a process holds a slice of the positions, so a parallelism sets
    :attr:`seen_length`; the module only calls it."""

    inv_freq: Tensor
    # this process's max(position_ids) + 1 (a 0-dim tensor) -> the whole sequence's (the
    # same on every process of its group; a collective, called by every process of the
    # group at each forward of the dynamic kind, never for the others); None: this
    # process holds the whole sequence
    seen_length: Callable[[Tensor], Tensor] | None = None

    def __init__(
        self, head_dim: int, rope: RopeConfig | float, max_position_embeddings: int = 1 << 20
    ) -> None:
        super().__init__()
        self.head_dim, self.max_position_embeddings = head_dim, max_position_embeddings
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.set_rope(rope if isinstance(rope, RopeConfig) else RopeConfig(theta=float(rope)))

    def set_rope(self, rope: RopeConfig) -> None:
        """Switch to ``rope`` (kind and parameters) in place, on the module's device, its
        dynamic state reset (a run moving to its next context-extension stage)."""
        self.rope = rope
        inv_freq, self.attention_scaling = rope_frequencies(
            rope, self.head_dim, self.max_position_embeddings
        )
        self.original_length = rope.original_length(self.max_position_embeddings) or 0
        self.longest_seen: Tensor | int = self.original_length  # dynamic's grown length
        self._original_fp32 = inv_freq  # plain attributes: no module cast reaches them
        self._fp32 = inv_freq
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"

    def _dynamic_update(self, position_ids: Tensor) -> None:
        """transformers' ``dynamic_frequency_update``, over the whole sequence's length."""
        device = position_ids.device
        if position_ids.numel():
            seq_len = position_ids.max() + 1
        else:  # a process holding no position: its length does not count
            seq_len = torch.zeros((), dtype=position_ids.dtype, device=device)
        if self.seen_length is not None:
            seq_len = self.seen_length(seq_len)
        longest = self.longest_seen
        if seq_len > longest:  # growth
            inv_freq, self.attention_scaling = rope_frequencies(
                self.rope, self.head_dim, self.max_position_embeddings, seq_len, device
            )
            self._fp32, self.inv_freq = inv_freq, inv_freq
            self.longest_seen = seq_len
        if seq_len < self.original_length and longest > self.original_length:  # reset
            self._original_fp32 = self._original_fp32.to(device)
            self._fp32, self.inv_freq = self._original_fp32, self._original_fp32
            self.longest_seen = self.original_length

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.rope.kind == "dynamic":
            self._dynamic_update(position_ids)
        if self.inv_freq.dtype != torch.float32:  # cast by an engine (bf16/fp16 buffers)
            self.inv_freq = self._fp32.to(self.inv_freq.device)
        # [b, n] x [d/2] -> [b, n, d/2], exact in fp64, then reduced to [0, 2π)
        angles = position_ids.to(torch.float64)[..., None] * self.inv_freq.to(torch.float64)
        freqs = torch.remainder(angles, 2 * math.pi).float()
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, n, d]
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [b, n, h, d]; cos/sin [b, n, d] -> [b, n, 1, d]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin
