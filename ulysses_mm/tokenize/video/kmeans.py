"""Nearest-codeword search and k-means, the two pieces of vector quantisation.

The nearest codeword of each row of ``x [n, d]`` among ``c [k, d]`` is
``argmin_j ||x||² - 2 x·c_j + ||c_j||²``; ``||x||²`` does not change the argmin, so one
``torch.addmm(||c||², x, cᵀ, alpha=-2)`` per chunk of rows does the work in a BLAS matmul
(no per-patch Python). k-means is Lloyd's algorithm on the same search, seeded by
k-means++ on a random subsample; an empty cluster is re-seeded with the point currently
worst served. Everything is float32 and seeded, so a fit is reproducible on one machine.

torch is imported by the functions that compute, not by the module, so the tokenize
layer stays torch-free to import (a VQ spec is loaded, routed and checked without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_CHUNK = 4096  # rows per matmul: bounds the [chunk, k] distance matrix


def nearest_index(x: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor) -> torch.Tensor:
    """Index [n] int64 of the nearest row of ``c`` for each row of ``x`` (float32)."""
    import torch  # lazy: the tokenize layer imports without torch

    idx = torch.empty(x.shape[0], dtype=torch.int64)
    ct = c.t()
    for s in range(0, x.shape[0], _CHUNK):
        d = torch.addmm(c_sq, x[s : s + _CHUNK], ct, alpha=-2.0)  # [chunk, k]: ||c||² - 2 x·c
        torch.argmin(d, dim=1, out=idx[s : s + _CHUNK])
    return idx


def nearest(
    x: torch.Tensor, c: torch.Tensor, c_sq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n] int64, squared distance [n] float32) of the nearest row of ``c``."""
    import torch  # lazy: the tokenize layer imports without torch

    if c_sq is None:
        c_sq = (c * c).sum(1)
    idx = torch.empty(x.shape[0], dtype=torch.int64)
    dist = torch.empty(x.shape[0], dtype=torch.float32)
    ct = c.t()
    for s in range(0, x.shape[0], _CHUNK):
        xs = x[s : s + _CHUNK]
        d = torch.addmm(c_sq, xs, ct, alpha=-2.0)  # [chunk, k] = ||c||² - 2 x·c
        m, i = d.min(dim=1)
        idx[s : s + _CHUNK] = i
        dist[s : s + _CHUNK] = (m + (xs * xs).sum(1)).clamp_min(0.0)
    return idx, dist


@dataclass
class Codebook:
    """``vectors [k, d]`` float32; encode rows to ids and ids back to rows."""

    vectors: np.ndarray
    _tensors: Any = field(default=None, init=False, repr=False)  # (c, ||c||²), at first encode

    def __post_init__(self) -> None:
        if self.vectors.ndim != 2 or self.vectors.shape[0] < 1:
            raise ValueError(f"a codebook is [k, d], got shape {self.vectors.shape}")
        self.vectors = np.ascontiguousarray(self.vectors, dtype=np.float32)

    @property
    def size(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def encode(self, x: np.ndarray) -> np.ndarray:
        """rows ``[n, d]`` (any real dtype) -> nearest ids ``[n]`` int64."""
        import torch  # lazy: the tokenize layer imports without torch

        if self._tensors is None:
            c = torch.from_numpy(self.vectors)
            self._tensors = (c, (c * c).sum(1))
        xt = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
        return nearest_index(xt, *self._tensors).numpy()

    def decode(self, ids: np.ndarray) -> np.ndarray:
        return self.vectors[np.asarray(ids, dtype=np.int64)]


def kmeans_pp_init(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (D² sampling) on the rows of ``x``; one mat-vec per centre."""
    import torch  # lazy: the tokenize layer imports without torch

    n = x.shape[0]
    x_sq = (x * x).sum(1)
    chosen = [int(torch.randint(n, (1,), generator=gen))]
    d2 = (x_sq - 2.0 * (x @ x[chosen[0]]) + x_sq[chosen[0]]).clamp_min(0.0)
    for _ in range(1, k):
        total = float(d2.sum())
        if total <= 0.0:  # fewer distinct points than k: repeat (re-seeded later if empty)
            i = int(torch.randint(n, (1,), generator=gen))
        else:
            i = int(torch.multinomial(d2 / total, 1, generator=gen))
        chosen.append(i)
        d2 = torch.minimum(d2, (x_sq - 2.0 * (x @ x[i]) + x_sq[i]).clamp_min(0.0))
    return x[chosen].clone()


@dataclass
class KMeansResult:
    centroids: np.ndarray  # [k, d] float32
    mse: list[float]  # per-element MSE at each iteration's assignment, then the final one
    iterations: int


def kmeans(
    x: np.ndarray | torch.Tensor,
    k: int,
    iters: int = 20,
    seed: int = 0,
    init_sample: int = 8192,
    tol: float = 1e-4,
) -> KMeansResult:
    """Lloyd's k-means on rows of ``x [n, d]``; stops early when the MSE improves < tol."""
    import torch  # lazy: the tokenize layer imports without torch

    xt = (x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))).float()
    xt = xt.contiguous()
    n, d = xt.shape
    if n < k:
        raise ValueError(f"k-means needs at least k={k} points, got {n}")
    gen = torch.Generator().manual_seed(seed)
    sub = xt[torch.randperm(n, generator=gen)[: max(init_sample, k)]]
    c = kmeans_pp_init(sub, k, gen)
    history: list[float] = []
    for _ in range(iters):
        idx, dist = nearest(xt, c)
        history.append(float(dist.mean()) / d)
        sums = torch.zeros_like(c).index_add_(0, idx, xt)
        counts = torch.bincount(idx, minlength=k).to(torch.float32)
        c = sums / counts.clamp_min(1.0)[:, None]
        empty = torch.nonzero(counts == 0).flatten()
        if empty.numel():
            worst = torch.argsort(dist, descending=True)[: empty.numel()]
            c[empty] = xt[worst]
        if len(history) > 1 and history[-2] - history[-1] < tol * history[-2]:
            break
    iterations = len(history)
    idx, dist = nearest(xt, c)
    history.append(float(dist.mean()) / d)
    return KMeansResult(c.numpy(), history, iterations)
