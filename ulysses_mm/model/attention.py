"""Local attention kernels over packed samples, and the document mask they share.

A kernel sees the FULL sequence on some heads (under Ulysses: after the all-to-all, H/P
heads) and must honour two rules: causal order, and no token attends across a document
boundary. Documents are the contiguous spans of equal ``doc_ids``; a kernel never sees the
segment table itself, only :class:`DocumentMask`, which is built once per batch and shared
by every layer.

Dims: b batch, s full sequence, hq query heads, hk key/value heads (hq % hk == 0), d head.
All kernels take q ``[b, s, hq, d]``, k and v ``[b, s, hk, d]`` and return ``[b, s, hq, d]``.

Kernels:
- ``flash_varlen``: flash-attn's varlen kernel (GPU, fp16/bf16 only; optional ``gpu``
  extra). ``auto`` picks it on CUDA in fp16/bf16 when flash-attn loads.
- ``sdpa_varlen``: PyTorch SDPA, causal, once per document (O(doc) memory with the fused
  CPU/GPU kernels). The default without flash-attn, and in fp32.
- ``sdpa_dense``: PyTorch SDPA with a dense [s, s] block-diagonal causal mask; O(s^2)
  memory, a simple reference.
- ``flex``: flex attention with a block mask built from the document spans (compiled on
  GPU; on CPU this torch has no flex backward, so it is available there only without
  gradients).

Which kernel runs is :func:`choose_kernel`, a pure function of (requested, device, dtype,
whether flash-attn loads); :func:`check_kernel_config` refuses a config that can never
run before any process starts.
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

from ulysses_mm.core.errors import ConfigError, UnsupportedError

KERNELS = ("flash_varlen", "sdpa_varlen", "sdpa_dense", "flex")

# training precision (deepspeed.precision) -> the dtype attention sees
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# flash-attn's kernels (and SDPA's flash backend on CUDA) take only these
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# flash-attn launches one grid row per sequence: gridDim.y is at most 65,535 on CUDA, so a
# varlen call over more documents is split
FLASH_MAX_DOCS = 65_535
# torch's flex attention block (_DEFAULT_SPARSE_BLOCK_SIZE): the block mask's tile
FLEX_BLOCK = 128


@dataclass
class DocumentMask:
    """Which tokens may attend to which: contiguous spans of ``doc_ids`` ([b, s], full
    sequence) are documents; attention is causal inside a document and zero across."""

    doc_ids: Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return int(self.doc_ids.shape[-1])

    @property
    def doc_index(self) -> Tensor:
        """[b, s] document index per token, counted per row from 0 (spans, not raw ids)."""
        if "doc_index" not in self._cache:
            d = self.doc_ids
            change = torch.zeros_like(d, dtype=torch.int32)
            change[:, 1:] = (d[:, 1:] != d[:, :-1]).to(torch.int32)
            self._cache["doc_index"] = torch.cumsum(change, dim=1, dtype=torch.int32)
        return self._cache["doc_index"]

    @property
    def spans(self) -> list[list[tuple[int, int]]]:
        """Per row, the (start, end) of every document (host-side, computed once)."""
        if "spans" not in self._cache:
            rows = []
            for row in self.doc_index.cpu():
                bounds = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
                edges = [0, *bounds, int(row.shape[0])]
                rows.append(list(itertools.pairwise(edges)))
            self._cache["spans"] = rows
        return self._cache["spans"]

    def dense(self) -> Tensor:
        """[b, 1, s, s] boolean: True where attention is allowed."""
        if "dense" not in self._cache:
            r = self.doc_index
            s = self.seq_len
            causal = torch.ones(s, s, dtype=torch.bool, device=r.device).tril()
            self._cache["dense"] = (r[:, :, None] == r[:, None, :]) & causal
            self._cache["dense"] = self._cache["dense"].unsqueeze(1)
        return self._cache["dense"]

    def flash_chunks(self) -> list[tuple[int, int, Tensor, int]]:
        """flash-attn varlen calls over the flattened batch, each of at most
        ``FLASH_MAX_DOCS`` documents: (first token, end token, cu_seqlens int32 from 0,
        max_seqlen)."""
        if "flash" not in self._cache:
            lengths = [e - s for row in self.spans for s, e in row]
            chunks = []
            t0 = 0
            for i in range(0, len(lengths), FLASH_MAX_DOCS):
                part = lengths[i : i + FLASH_MAX_DOCS]
                cu = torch.zeros(len(part) + 1, dtype=torch.int32)
                cu[1:] = torch.cumsum(torch.tensor(part, dtype=torch.int32), 0)
                t1 = t0 + int(cu[-1])
                chunks.append((t0, t1, cu.to(self.doc_ids.device), max(part)))
                t0 = t1
            self._cache["flash"] = chunks
        return self._cache["flash"]

    def block_mask(self, num_heads: int):
        """flex attention's BlockMask, built from the document spans at block level.

        A [FLEX_BLOCK]² tile (q block i, kv block j) is needed when j <= i and the two
        blocks share a document, and is full (no mask_mod call) when j < i and both lie in
        one document. Only [b, 1, s/128, s/128] block tables are ever made — never the
        [b, 1, s, s] mask that ``create_block_mask`` evaluates element by element."""
        key = ("block", num_heads)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import (
                BlockMask,  # lazy: only the flex backend needs it
            )

            r = self.doc_index  # [b, s]
            s = self.seq_len
            blocks = -(-s // FLEX_BLOCK)
            idx = torch.arange(blocks, device=r.device)
            first = r[:, idx * FLEX_BLOCK]  # [b, nb] document of each block's first token
            last = r[:, ((idx + 1) * FLEX_BLOCK).clamp(max=s) - 1]  # ... and of its last
            qi, kj = idx[:, None], idx[None, :]
            # document indices never decrease along a row: kv block j <= i shares a
            # document with q block i iff the document that starts block i has not ended
            # before block j's end
            touch = (kj <= qi) & (first[:, :, None] <= last[:, None, :])  # [b, nb, nb]
            whole = idx < s // FLEX_BLOCK  # blocks without padding past s
            full = (
                (kj < qi)
                & whole[:, None]
                & whole[None, :]
                & (first[:, None, :] == last[:, :, None])  # block j's first = block i's last
            )
            partial = touch & ~full
            del touch

            def ordered(m: Tensor) -> tuple[Tensor, Tensor]:
                # [b, nb, nb] -> per q block: the count of kv blocks and their indices first
                num = m.sum(-1, dtype=torch.int32)[:, None]  # [b, 1, nb]
                order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
                return num, order.to(torch.int32)[:, None]  # [b, 1, nb, nb]

            def allowed(b, h, qi, ki):
                return (qi >= ki) & (r[b, qi] == r[b, ki])

            kv_num, kv_idx = ordered(partial)
            del partial
            full_num, full_idx = ordered(full)
            del full
            self._cache[key] = BlockMask.from_kv_blocks(
                kv_num,
                kv_idx,
                full_num,
                full_idx,
                BLOCK_SIZE=FLEX_BLOCK,
                mask_mod=allowed,
                seq_lengths=(s, s),
            )
        return self._cache[key]


def sdpa_native_gqa(device: str, dtype: torch.dtype, masked: bool = False) -> bool:
    """Whether SDPA may be given ``enable_gqa`` (fewer kv heads than query heads).

    On CUDA only the flash backend takes it, and that backend runs only fp16/bf16 without
    an explicit mask; elsewhere SDPA falls back to its math kernel, which materialises
    heads × L² per call. There the kernels expand k, v to the query heads instead. On CPU
    the fused kernel takes ``enable_gqa`` in every dtype."""
    if device != "cuda":
        return True
    return dtype in FLASH_DTYPES and not masked


def _gqa(q: Tensor, k: Tensor, v: Tensor, masked: bool = False) -> tuple[Tensor, Tensor, bool]:
    """(k, v, enable_gqa) for SDPA: k, v as they are where SDPA takes GQA natively, else
    repeated to the query heads ([b, s, hk, d] -> [b, s, hq, d])."""
    if q.shape[2] == k.shape[2]:
        return k, v, False
    if sdpa_native_gqa(q.device.type, q.dtype, masked):
        return k, v, True
    rep = q.shape[2] // k.shape[2]
    # query head i reads kv head i // rep, as enable_gqa does
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2), False


def _sdpa_dense(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    k, v, gqa = _gqa(q, k, v, masked=True)
    # [b, s, h, d] -> [b, h, s, d]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.dense(),
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]


def _sdpa_varlen(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    k, v, gqa = _gqa(q, k, v)
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
    from torch.nn.attention.flex_attention import (
        flex_attention,  # lazy: only the flex backend needs it
    )

    # dynamic=None: the first new sequence length recompiles once with symbolic shapes, and
    # later lengths reuse that graph (dynamic=False would compile once per length and, past
    # torch's recompile limit, fall back to eager attention)
    return torch.compile(flex_attention, dynamic=None)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    from torch.nn.attention.flex_attention import (
        flex_attention,  # lazy: only the flex backend needs it
    )

    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise UnsupportedError(
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


@functools.cache
def _flash_varlen_func() -> Callable[..., Tensor] | None:
    """flash-attn's varlen function, imported once; None when flash-attn is absent or does
    not load. A wheel built for another torch or CUDA is found by ``find_spec`` but fails
    when its CUDA extension is imported: that falls back to SDPA with one warning."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func  # lazy: optional (flash_attn)
    except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError ...
        why = str(e).splitlines()[0][:200] if str(e) else ""
        warnings.warn(
            f"flash-attn is installed but does not load ({type(e).__name__}: {why}); "
            "attention falls back to sdpa_varlen (rebuild flash-attn for this torch and CUDA)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and _flash_varlen_func() is not None


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    fn = _flash_varlen_func()
    if fn is None:
        raise UnsupportedError("flash-attn does not load here; use parallel.attention=sdpa_varlen")
    b, s, h, d = q.shape
    # [b, s, h, d] -> [b*s, h, d]; documents are cu-delimited
    qf, kf, vf = (t.reshape(b * s, t.shape[2], d) for t in (q, k, v))
    outs = [
        fn(
            qf[t0:t1],
            kf[t0:t1],
            vf[t0:t1],
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
            causal=True,
        )
        for t0, t1, cu, max_len in mask.flash_chunks()  # <= FLASH_MAX_DOCS documents each
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
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


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in PRECISION_DTYPES:
        raise ConfigError(
            f"unknown precision {dtype!r}; choose one of {', '.join(PRECISION_DTYPES)}"
        )
    return PRECISION_DTYPES[dtype]


def choose_kernel(
    requested: str, device: str | None, dtype: torch.dtype | str | None, flash: bool
) -> str:
    """The kernel that runs for ``requested`` (``auto`` or a name of KERNELS) on ``device``
    ("cuda", "cpu"; None: not known yet) in ``dtype`` (a torch dtype or a precision name;
    None: not known yet), where ``flash`` says whether flash-attn loads and a GPU is present.

    ``auto``: flash_varlen on CUDA in fp16/bf16 when flash-attn loads, else sdpa_varlen.
    An explicit ``flash_varlen`` in fp32 is a :class:`ConfigError`; where flash-attn or a
    GPU is missing, an :class:`UnsupportedError`."""
    dt = _dtype(dtype)
    if requested == "auto":
        low = dt in FLASH_DTYPES
        return "flash_varlen" if device == "cuda" and flash and low else "sdpa_varlen"
    if requested not in KERNELS:
        raise ConfigError(
            f"unknown attention kernel {requested!r}; choose one of auto, {', '.join(KERNELS)}"
        )
    if requested == "flash_varlen":
        if dt is not None and dt not in FLASH_DTYPES:
            raise ConfigError(
                "parallel.attention=flash_varlen needs deepspeed.precision bf16 or fp16 "
                f"(flash-attn has no {str(dt).removeprefix('torch.')} kernel); use auto or "
                "sdpa_varlen"
            )
        if not flash or device not in (None, "cuda"):
            raise UnsupportedError(
                "parallel.attention=flash_varlen needs flash-attn and a CUDA GPU "
                "(pip install 'ulysses-mm[gpu]'); use auto or sdpa_varlen"
            )
    return requested


def check_kernel_config(attention: str, precision: str) -> None:
    """Refuse, with one line, a kernel/precision pair that can never run (whatever the
    machine): call before any process starts."""
    choose_kernel(attention, None, precision, flash=True)


def resolve_kernel(name: str, device: str, dtype: torch.dtype | str) -> str:
    """:func:`choose_kernel` on this machine (flash-attn loaded once)."""
    return choose_kernel(name, device, dtype, flash_attn_available())


class LocalAttention(nn.Module):
    """Causal, document-masked attention over the whole sequence it is given.

    ``kernel='auto'`` is resolved at each call from the input's device and dtype."""

    def __init__(self, kernel: str = "auto") -> None:
        super().__init__()
        if kernel != "auto":
            # an unknown or unavailable kernel fails here, clearly (device, dtype: at call)
            choose_kernel(kernel, None, None, flash_attn_available())
        self.kernel = kernel

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
        if q.shape[1] != mask.seq_len:
            raise ValueError(
                f"attention got a sequence of {q.shape[1]} tokens but the document mask covers "
                f"{mask.seq_len}"
            )
        name = resolve_kernel(self.kernel, q.device.type, q.dtype)
        return _IMPLS[name](q, k, v, mask)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}"
