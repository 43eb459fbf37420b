"""A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) in plain PyTorch.

Parameter names and maths match ``transformers.LlamaModel`` for the config
:meth:`ModelConfig.to_llama_config_kwargs` gives, so the backbone's state dict loads there
as is. The model knows nothing of process groups: attention calls an injected ``core``
module (a :class:`LocalAttention`), which :func:`ulysses_mm.parallel.apply_ulysses`
swaps for the sequence-parallel wrapper.

Dims: b batch, n tokens held by this process (s/P under Ulysses), s full sequence,
D hidden, hq/hk query/key-value heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ulysses_mm.config import ModelConfig
from ulysses_mm.core.errors import ConfigError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.model.heads import LossOutput, ModalityHeads
from ulysses_mm.model.rope import RotaryEmbedding, apply_rope

# (hidden, labels, label_modality, bins or None) -> the same, rearranged over ranks
TargetExchange = Callable[
    [Tensor, Tensor, Tensor, "Tensor | None"], tuple[Tensor, Tensor, Tensor, "Tensor | None"]
]


class RMSNorm(nn.Module):
    weight: nn.Parameter

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernel: str = "auto") -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        bias = cfg.attention_bias  # Qwen2: q/k/v biases, none on o_proj
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, cfg.hidden_size, bias=False)
        # Qwen3: RMSNorm over each head's d features of q and k, before RoPE
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.core: nn.Module = LocalAttention(kernel)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel's inputs, RoPE applied: token-wise."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)  # [b, n, hq, d]
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)  # [b, n, hk, d]
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)  # [b, n, hk, d]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over d
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: Tensor) -> Tensor:
        """[b, n, hq, d] kernel output -> [b, n, D]: token-wise."""
        b, n = o.shape[:2]
        return self.o_proj(o.reshape(b, n, self.num_heads * self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.out(self.core(q, k, v, mask))  # core: [b, n, hq, d]


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention and MLP, each behind a residual add, in three steps: :meth:`qkv`
    (token-wise), the attention kernel ``self_attn.core``, :meth:`after_attention`
    (token-wise). A memory policy (:mod:`ulysses_mm.model.memory`) wraps the token-wise
    steps from outside; a KV-cache decoder calls them itself around its own kernel."""

    def __init__(self, cfg: ModelConfig, kernel: str = "auto") -> None:
        super().__init__()
        self.self_attn = Attention(cfg, kernel)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The token-wise part before the attention kernel: its q, k, v [b, n, h, d]."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: Tensor, o: Tensor) -> Tensor:
        """The token-wise part after the kernel's output ``o`` [b, n, hq, d] -> [b, n, D]
        (a KV-cache decoder runs the kernel's part itself between the two)."""
        x = x + self.self_attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)  # [b, n, h, d]
        o = self.self_attn.core(q, k, v, mask)  # [b, n, hq, d]
        return self.after_attention(x, o)  # [b, n, D]


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm: ``transformers.LlamaModel``'s layout."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, kernel: str = "auto") -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernel) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)

    def forward(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor) -> Tensor:
        """input_ids, position_ids: [b, n] (this process's tokens); doc_ids: [b, s] for the
        FULL sequence (s = n without sequence parallelism). Returns [b, n, D]."""
        mask = DocumentMask(doc_ids)
        x = self.embed_tokens(input_ids)  # [b, n] -> [b, n, D]
        cos, sin = self.rotary_emb(position_ids, x.dtype)  # [b, n, d] each
        x = self.run_layers(x, cos, sin, mask)
        return self.norm(x)

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, mask: DocumentMask) -> Tensor:
        """``x`` [b, n, D] through every decoder layer (a memory policy may checkpoint or
        offload them: :mod:`ulysses_mm.model.memory`)."""
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class MultimodalLM(nn.Module):
    """The backbone plus one output head per modality of the token space."""

    config: ModelConfig
    space: TokenSpace
    model: Backbone
    heads: ModalityHeads
    # rearranges (hidden, labels, label_modality, bins) before the heads; a parallelism
    # sets it (ulysses_mm.parallel.loss_balance), the model only calls it
    target_exchange: TargetExchange | None = None

    def __init__(self, cfg: ModelConfig, space: TokenSpace, kernel: str = "auto") -> None:
        super().__init__()
        self.config = cfg
        self.space = space
        self.model = Backbone(cfg, space.vocab_size, kernel)
        self.heads = ModalityHeads(cfg.hidden_size, space)  # loss tiles: the memory policy's
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        embedding_std = self.config.embedding_init_std or std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(
                    0.0, embedding_std if isinstance(module, nn.Embedding) else std
                )
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_ids: Tensor,
        labels: Tensor,
        label_modality: Tensor,
        bins: Tensor | None = None,
        num_bins: int = 0,
    ) -> LossOutput:
        """The loss terms of :meth:`loss_terms` of this process's targets (one call the
        training engine can wrap); with ``bins`` the CE sums per bin too. Hidden states
        alone: :meth:`hidden_states`."""
        hidden = self.model(input_ids, position_ids, doc_ids)
        return self.loss_terms(hidden, labels, label_modality, bins, num_bins)

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor) -> Tensor:
        """The backbone's last hidden states [b, n, D] of this process's tokens (doc_ids
        [b, s] of the full sequence): :meth:`Backbone.forward`."""
        return self.model(input_ids, position_ids, doc_ids)  # type: ignore[no-any-return]

    def loss_terms(
        self,
        hidden: Tensor,
        labels: Tensor,
        label_modality: Tensor,
        bins: Tensor | None = None,
        num_bins: int = 0,
    ) -> LossOutput:
        """Per-modality (sum of cross-entropy, count of targets) over this process's tokens
        (over the targets :attr:`target_exchange` gives it, when set; their position bins
        travel with them), and with ``bins`` the sums per bin:
        :meth:`ModalityHeads.loss_terms`."""
        if self.target_exchange is not None:
            hidden, labels, label_modality, bins = self.target_exchange(
                hidden, labels, label_modality, bins
            )
        return self.heads.loss_terms(hidden, labels, label_modality, bins, num_bins)


def build_model(
    cfg: ModelConfig, space: TokenSpace | None = None, kernel: str = "auto", seed: int | None = None
) -> MultimodalLM:
    """Build the model for ``cfg`` (token space from ``cfg.modalities`` unless given)."""
    if space is None:
        if not cfg.modalities:
            raise ConfigError("model.modalities is empty: give a token space (from a manifest)")
        space = TokenSpace.from_vocab(cfg.modalities)
    if seed is not None:
        torch.manual_seed(seed)
    return MultimodalLM(cfg, space, kernel)
