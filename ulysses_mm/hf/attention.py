"""Our Ulysses × ring attention as a transformers attention implementation.

:func:`register` adds ``attn_implementation="ulysses_mm"`` to transformers' registry. A
model built with it (Llama, Qwen2, Qwen3, Mistral: any model whose attention calls the
registry) runs, in every layer, :class:`~ulysses_mm.parallel.UlyssesAttention` over the
mesh's Ulysses group with :class:`~ulysses_mm.parallel.RingAttention` across the ring when
``mesh.ring_size`` > 1, around our local kernels (:mod:`ulysses_mm.model.attention`): causal,
and no token attends across a document boundary, on every kernel. GQA with fewer kv heads
than the Ulysses group replicates kv heads; a ring lets sp exceed the head count.

Documents come from the inputs, never from a mask: ``cu_seq_lens_q`` when given (the
whole sequence's documents, as :func:`~ulysses_mm.hf.inputs.shard_inputs` passes them),
else ``position_ids`` gathered over the SP group (a document starts wherever the position
does not follow the previous one). The :class:`DocumentMask` is built once per forward and
shared by the layers (they all receive the same tensor). transformers builds no [s, s]
mask for the backend; a 2D ``attention_mask`` that masks any token is refused (padding is
a document of its own whose targets are ignored).

:func:`isolate_documents` puts the same local kernels (one process, no collectives) under
an existing implementation's name, for a stack that accepts only that name as the core of
its own sequence parallelism: DeepSpeed's ``UlyssesSPAttentionHF`` under Accelerate's
``ParallelismConfig`` takes ``sdpa``, and with transformers' own SDPA the gathered
sequence's documents attend to each other.

Dims: b batch, n tokens this rank holds, hq / hk query / key-value heads, d head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ulysses_mm.core.errors import UnsupportedError
from ulysses_mm.hf.inputs import document_ids, documents_from_cu
from ulysses_mm.model.attention import DocumentMask, LocalAttention
from ulysses_mm.parallel.comm import CommStats, Workspace
from ulysses_mm.parallel.mesh import Mesh
from ulysses_mm.parallel.ring import RingAttention
from ulysses_mm.parallel.ulysses import UlyssesAttention

NAME = "ulysses_mm"


@dataclass
class Backend:
    """What one registration runs: the mesh, the local kernel, the counters, and the
    attention modules (one per head shape) and document mask it reuses."""

    mesh: Mesh
    kernel: str = "auto"
    stats: CommStats | None = None
    ring_stats: dict[str, int] | None = None
    fallback: Callable[..., Any] | None = None  # decoding with a KV cache (one process)
    workspace: Workspace = field(default_factory=Workspace)
    _modules: dict[tuple[int, int], nn.Module] = field(default_factory=dict)
    _mask_source: Any = None
    _mask: DocumentMask | None = None

    def module(self, num_heads: int, num_kv_heads: int) -> nn.Module:
        """The attention for this head shape (its layout checked once, in one line)."""
        key = (num_heads, num_kv_heads)
        if key not in self._modules:
            m = self.mesh
            m.layout.check(num_heads, num_kv_heads)
            core: nn.Module = LocalAttention(self.kernel)
            if m.ring_size > 1:
                core = RingAttention(
                    m.ring_group, m.ring_members, m.ring_rank, self.ring_stats, self.kernel
                )
            group = m.ulysses_group if m.sp > 1 else None
            self._modules[key] = UlyssesAttention(
                core,
                group,
                num_heads,
                num_kv_heads,
                self.stats,
                self.workspace,
                ring_size=m.ring_size,
                head_groups=m.layout.head_groups,
            )
        return self._modules[key]

    def document_mask(self, kwargs: dict[str, Any], batch: int, local_len: int) -> DocumentMask:
        """The whole sequence's documents, from ``cu_seq_lens_q`` or the gathered
        ``position_ids``; built once for the tensor every layer of a forward receives."""
        source = kwargs.get("cu_seq_lens_q")
        if source is None:
            source = kwargs.get("position_ids")
        if source is None:
            raise UnsupportedError(
                "attn_implementation='ulysses_mm' needs position_ids (restarting at every "
                "document) or cu_seq_lens_q in the model's inputs"
            )
        m = self.mesh
        seq_len = local_len * m.sp
        cached = self._mask
        shape = (batch, seq_len)
        if cached is not None and source is self._mask_source and cached.doc_ids.shape == shape:
            return cached
        if kwargs.get("cu_seq_lens_q") is not None:
            doc_ids = documents_from_cu(source, batch, seq_len)
        else:
            if m.ring_size > 1:
                raise UnsupportedError(
                    "with a ring the tokens of a rank are in the document zigzag, so the "
                    "backend needs the whole sequence's documents: pass the inputs through "
                    "ulysses_mm.hf.shard_inputs (it adds cu_seq_lens_q)"
                )
            pos = source.expand(batch, -1)
            if m.sp > 1:
                parts = [torch.empty_like(pos) for _ in range(m.sp)]
                dist.all_gather(parts, pos.contiguous(), group=m.sp_group)
                pos = torch.cat(parts, dim=1)
            if pos.shape[1] != seq_len:
                raise ValueError(
                    f"position_ids cover {pos.shape[1]} tokens; the sequence has {seq_len}"
                )
            doc_ids = document_ids(pos)
        self._mask_source, self._mask = source, DocumentMask(doc_ids)
        return self._mask

    def __call__(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        """transformers' attention interface: q [b, hq, n, d], k and v [b, hk, n, d] ->
        ([b, n, hq, d], no weights)."""
        if key.shape[2] != query.shape[2]:  # decoding against a KV cache
            if self.mesh.sp > 1 or self.fallback is None:
                raise UnsupportedError(
                    "decoding with a KV cache runs in one process: generate with sp=1"
                )
            return self.fallback(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
        _refuse_unsupported(module, dropout, kwargs)
        b, hq, n, d = query.shape
        # [b, h, n, d] -> [b, n, h, d]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if scaling is not None and not math.isclose(scaling, d**-0.5, rel_tol=1e-6):
            q = q * (scaling * math.sqrt(d))  # our kernels scale by 1/sqrt(d)
        mask = self.document_mask(kwargs, b, n)
        window = kwargs.get("sliding_window")
        if window is not None:
            longest = max(e - s for row in mask.spans for s, e in row)
            if longest > window:
                raise UnsupportedError(
                    f"a document of {longest} tokens exceeds the model's sliding window of "
                    f"{window}; attn_implementation='ulysses_mm' runs full causal attention "
                    "inside a document (set config.sliding_window=None, or keep documents "
                    "within the window)"
                )
        out = self.module(hq, k.shape[2])(q, k, v, mask)  # [b, n, hq, d]
        return out, None


def _refuse_unsupported(module: nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout and module.training:
        raise UnsupportedError(
            f"attention dropout {dropout} is not supported by attn_implementation='ulysses_mm'"
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedError(
            "attention logit softcapping and attention sinks are not supported by "
            "attn_implementation='ulysses_mm'"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedError("attn_implementation='ulysses_mm' is causal attention only")
    if kwargs.get("output_attentions"):
        raise UnsupportedError("attn_implementation='ulysses_mm' returns no attention weights")


def _no_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask hook: no [s, s] mask is built (the backend takes documents from
    the inputs); a 2D mask that hides a token cannot be honoured, so it is refused."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise UnsupportedError(
            "attn_implementation='ulysses_mm' takes no padding mask: give pads their own "
            "positions (a document of their own) and ignore their targets (labels -100)"
        )
    return None


def _install(name: str, backend: Backend) -> str:
    from transformers import AttentionInterface  # lazy: heavy (transformers)
    from transformers.masking_utils import AttentionMaskInterface  # lazy: heavy (transformers)

    AttentionInterface.register(name, backend)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def _sdpa() -> Callable[..., Any]:
    from transformers.integrations.sdpa_attention import (
        sdpa_attention_forward,  # lazy: heavy (transformers)
    )

    return sdpa_attention_forward


def register(
    mesh: Mesh | None = None,
    kernel: str = "auto",
    stats: CommStats | None = None,
    ring_stats: dict[str, int] | None = None,
) -> str:
    """Register ``attn_implementation="ulysses_mm"`` over ``mesh`` (None: one process,
    document isolation only) and return the name. ``kernel`` is the local kernel setting
    (``auto``, ``sdpa_varlen``, ``flash_varlen``, ...); ``stats`` / ``ring_stats`` count
    the bytes of the all-to-all and the ring. Registering again replaces the mesh.

    Under SP every rank feeds its own tokens (:func:`~ulysses_mm.hf.inputs.shard_inputs`);
    decoding against a KV cache runs only with sp = 1 (transformers' SDPA on the cache)."""
    mesh = mesh or Mesh.single()
    return _install(NAME, Backend(mesh, kernel, stats, ring_stats, fallback=_sdpa()))


def isolate_documents(core: str = "sdpa", kernel: str = "auto") -> str:
    """Make attention implementation ``core`` (by default transformers' ``sdpa``) our
    one-process document-isolating kernels, keeping the original for decoding against a
    KV cache. For a sequence-parallel wrapper that takes only ``core`` and calls it on
    the gathered sequence with the gathered ``position_ids`` (DeepSpeed's
    ``UlyssesSPAttentionHF``, which captures ``core`` when Accelerate prepares the model:
    call this first). Returns ``core``."""
    from transformers import AttentionInterface  # lazy: heavy (transformers)

    original = cast("Callable[..., Any] | None", AttentionInterface._global_mapping.get(core))
    if isinstance(original, Backend):  # already isolated
        return core
    if original is None:
        raise UnsupportedError(f"transformers has no attention implementation {core!r}")
    return _install(core, Backend(Mesh.single(), kernel, fallback=original))
