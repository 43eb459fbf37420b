"""Local attention kernels over packed samples, and the document mask they share.

A kernel sees the FULL sequence on some heads (under Ulysses: after the all-to-all, H/P
heads) and must honour two rules: causal order, and no token attends across a document
boundary. Documents are the contiguous runs of equal ``doc_ids``; a kernel never sees the
segment table itself, only :class:`DocumentMask`, which is built once per batch and shared
by every layer.

Dims: b batch, s full sequence, hq query heads, hk key/value heads (hq % hk == 0), d head.
All kernels take q ``[b, s, hq, d]``, k and v ``[b, s, hk, d]`` and return ``[b, s, hq, d]``.

Kernels:
- ``flash_varlen``: flash-attn's varlen kernel (GPU, fp16/bf16; optional ``gpu`` extra).
- ``sdpa_varlen``: PyTorch SDPA, causal, once per document (O(doc) memory with the fused
  CPU/GPU kernels). The default without flash-attn.
- ``sdpa_dense``: PyTorch SDPA with a dense [s, s] block-diagonal causal mask; O(s^2)
  memory, a simple reference.
- ``flex``: flex attention with a block mask (compiled on GPU; on CPU this torch has no
  flex backward, so it is available there only without gradients).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KERNELS = ("flash_varlen", "sdpa_varlen", "sdpa_dense", "flex")


@dataclass
class DocumentMask:
    """Which tokens may attend to which: contiguous runs of ``doc_ids`` ([b, s], full
    sequence) are documents; attention is causal inside a document and zero across."""

    doc_ids: Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return int(self.doc_ids.shape[-1])

    @property
    def run_ids(self) -> Tensor:
        """[b, s] document index per token, counted per row from 0 (runs, not raw ids)."""
        if "run_ids" not in self._cache:
            d = self.doc_ids
            change = torch.zeros_like(d, dtype=torch.int32)
            change[:, 1:] = (d[:, 1:] != d[:, :-1]).to(torch.int32)
            self._cache["run_ids"] = torch.cumsum(change, dim=1, dtype=torch.int32)
        return self._cache["run_ids"]

    @property
    def spans(self) -> list[list[tuple[int, int]]]:
        """Per row, the (start, end) of every document (host-side, computed once)."""
        if "spans" not in self._cache:
            rows = []
            for row in self.run_ids.cpu():
                bounds = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
                edges = [0, *bounds, int(row.shape[0])]
                rows.append(list(itertools.pairwise(edges)))
            self._cache["spans"] = rows
        return self._cache["spans"]

    def cu_seqlens(self) -> tuple[Tensor, int]:
        """flash-attn varlen form over the flattened batch: (cu_seqlens int32, max_seqlen)."""
        if "cu" not in self._cache:
            lengths = [e - s for row in self.spans for s, e in row]
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
            self._cache["cu"] = (cu.to(self.doc_ids.device), max(lengths))
        return self._cache["cu"]

    def dense(self) -> Tensor:
        """[b, 1, s, s] boolean: True where attention is allowed."""
        if "dense" not in self._cache:
            r = self.run_ids
            s = self.seq_len
            causal = torch.ones(s, s, dtype=torch.bool, device=r.device).tril()
            self._cache["dense"] = (r[:, :, None] == r[:, None, :]) & causal
            self._cache["dense"] = self._cache["dense"].unsqueeze(1)
        return self._cache["dense"]

    def block_mask(self, num_heads: int):
        key = ("block", num_heads)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            r = self.run_ids

            def allowed(b, h, qi, ki):
                return (qi >= ki) & (r[b, qi] == r[b, ki])

            self._cache[key] = create_block_mask(
                allowed, r.shape[0], None, self.seq_len, self.seq_len, device=r.device
            )
        return self._cache[key]


def _sdpa_dense(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    # [b, s, h, d] -> [b, h, s, d]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.dense(),
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]


def _sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    gqa = q.shape[2] != k.shape[2]
    rows = []
    for b, spans in enumerate(mask.spans):
        # [b, s, h, d] -> [1, h, s, d] per row (a view), split into documents. split (not
        # slicing) keeps the backward one concatenation instead of a zero-filled full-size
        # gradient per document; 4-D inputs let SDPA use its fused flash kernel (O(doc)
        # memory) on CPU and GPU.
        lengths = [e - s for s, e in spans]
        docs = zip(*(t[b : b + 1].transpose(1, 2).split(lengths, dim=2) for t in (q, k, v)))
        outs = [
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
            for qd, kd, vd in docs
        ]
        rows.append(torch.cat(outs, dim=2))  # [1, h, s, d]
    return torch.cat(rows).transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise RuntimeError(
            "flex attention has no backward on CPU in this torch; use parallel.attention="
            "sdpa_varlen for training on CPU"
        )
    fn: Callable[..., Tensor] = _compiled_flex() if q.is_cuda else flex_attention  # type: ignore[assignment]
    with warnings.catch_warnings():
        # eager flex on CPU materialises scores (it warns so); fine for inference and tests
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            block_mask=mask.block_mask(q.shape[2]),
            enable_gqa=q.shape[2] != k.shape[2],
        )
    return out.transpose(1, 2)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    b, s, h, d = q.shape
    cu, max_len = mask.cu_seqlens()
    out = flash_attn_varlen_func(
        q.reshape(b * s, h, d),  # [b, s, h, d] -> [b*s, h, d]; documents are cu-delimited
        k.reshape(b * s, k.shape[2], d),
        v.reshape(b * s, v.shape[2], d),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        causal=True,
    )
    return out.reshape(b, s, h, d)


_IMPLS: dict[str, Callable[[Tensor, Tensor, Tensor, DocumentMask], Tensor]] = {
    "flash_varlen": _flash_varlen,
    "sdpa_varlen": _sdpa_varlen,
    "sdpa_dense": _sdpa_dense,
    "flex": _flex,
}


def available_kernels(training: bool = True, device: str = "cpu") -> list[str]:
    """Kernels usable here (``training``: with a backward)."""
    out = ["sdpa_varlen", "sdpa_dense"]
    if device == "cuda" or not training:
        out.append("flex")
    if device == "cuda" and flash_attn_available():
        out.insert(0, "flash_varlen")
    return out


def resolve_kernel(name: str, device: str = "cpu") -> str:
    if name == "auto":
        return "flash_varlen" if device == "cuda" and flash_attn_available() else "sdpa_varlen"
    if name not in _IMPLS:
        raise ValueError(
            f"unknown attention kernel {name!r}; choose one of auto, {', '.join(KERNELS)}"
        )
    if name == "flash_varlen" and not flash_attn_available():
        raise RuntimeError(
            "parallel.attention=flash_varlen needs flash-attn and a CUDA GPU "
            "(pip install 'ulysses-mm[gpu]'); use auto or sdpa_varlen"
        )
    return name


class LocalAttention(nn.Module):
    """Causal, document-masked attention over the whole sequence it is given.

    ``kernel='auto'`` is resolved on first call from the input's device."""

    def __init__(self, kernel: str = "auto") -> None:
        super().__init__()
        if kernel != "auto":
            resolve_kernel(kernel)  # an unknown or unavailable kernel fails here, clearly
        self.kernel = kernel

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        if q.shape[1] != mask.seq_len:
            raise ValueError(
                f"attention got a sequence of {q.shape[1]} tokens but the document mask covers "
                f"{mask.seq_len}"
            )
        name = resolve_kernel(self.kernel, q.device.type)
        return _IMPLS[name](q, k, v, mask)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}"
