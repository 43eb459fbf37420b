"""Video as predictive gain–shape VQ tokens (kind ``video-gsvq``): one id per patch per frame.

Per clip, frames as the ``video-vq`` kind samples them (fps, resize, centre crop, patches)::

    base        inter: the decoder's reconstruction of the previous frame (grey before
                frame 0); intra: mid-grey — per patch, whichever codes it with less error
    residual    r   = x - base, per patch, projected on a fitted basis B [D, p·p·3]
    shape       s   = the codeword of a unit-norm codebook [K, D] with the largest |r·s|
    gain        g   = r·s, its magnitude quantised to one of L log-spaced levels, its sign kept
    id          0 (keep the patch: |g| below half the smallest level), else
                1 + mode·2KL + (s·2 + sign)·L + level  (mode 0 inter, 1 intra;
                vocab_size = 1 + 4·K·L)
    reconstruction  base + g·(s B), rounded and clipped to 0..255: the next prediction

The encoder runs the decoder's own reconstruction (closed loop), so errors never drift.
Gain–shape splits how much changes (gain, any scale) from how it looks (shape, unit norm):
one codebook serves a whole first frame and the small refinements after it, and it
generalises to footage it was not fitted on, because a shape is independent of contrast
and brightness. A static region gains detail with every frame; motion spends the id on the
change. Tokens per frame stay ``(size/patch)²``; decoding frame t needs frames 0..t-1 (the
whole document, which is how clips are tokenized anyway).

The artifact is one ``.npz`` (``basis`` [D, p·p·3], ``shapes`` [K, D], ``gains`` [L], all
float32; loaded with ``allow_pickle=False``), written by
``ulysses-mm tokenizer fit video --kind video-gsvq``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ulysses_mm.modalities.base import TokenizerSpec
from ulysses_mm.modalities.video import VqVideoTokenizer, patchify, unpatchify

GREY = 128.0


@dataclass
class GainShapeModel:
    basis: np.ndarray  # [D, d] float32, orthonormal rows
    shapes: np.ndarray  # [K, D] float32, unit-norm rows
    gains: np.ndarray  # [L] float32, increasing, > 0

    def __post_init__(self) -> None:
        self.basis = np.ascontiguousarray(self.basis, dtype=np.float32)
        self.shapes = np.ascontiguousarray(self.shapes, dtype=np.float32)
        self.gains = np.ascontiguousarray(self.gains, dtype=np.float32)
        self._b = torch.from_numpy(self.basis)
        self._s = torch.from_numpy(self.shapes)
        self._log_g = torch.from_numpy(np.log(self.gains))
        self._z_grey: torch.Tensor | None = None

    @property
    def per_mode(self) -> int:
        return 2 * self.shapes.shape[0] * self.gains.shape[0]

    @property
    def vocab_size(self) -> int:
        return 1 + 2 * self.per_mode

    def _quantise(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residuals in the basis [n, D] -> (ids within one mode [n], 0: keep; their
        quantised value g·s [n, D])."""
        corr = z @ self._s.t()  # [n, K]
        best = corr.abs().argmax(dim=1)
        g = corr.gather(1, best[:, None])[:, 0]
        mag = g.abs().clamp_min(1e-12)
        # nearest level in the log domain; below half the smallest level: keep (id 0)
        level = (mag.log()[:, None] - self._log_g[None, :]).abs().argmin(dim=1)
        sign = (g < 0).to(torch.int64)
        ids = 1 + (best * 2 + sign) * self.gains.shape[0] + level
        keep = mag < 0.5 * float(self.gains[0])
        gq = torch.from_numpy(self.gains)[level] * (1 - 2 * sign).to(torch.float32)
        gq = torch.where(keep, torch.zeros_like(gq), gq)
        return torch.where(keep, torch.zeros_like(ids), ids), gq[:, None] * self._s[best]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Patches [..., d] -> their coordinates in the basis [..., D]."""
        return x @ self._b.t()

    def step(
        self, x: torch.Tensor, prev: torch.Tensor, zx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame's patches [n, d] and the previous reconstruction [n, d] -> (ids [n],
        reconstruction [n, d]): per patch the better of predicting from the previous frame
        (inter) or from mid-grey (intra: a scene cut, fast motion). ``zx``: x projected,
        if the caller has it (one matmul for a batch of frames)."""
        if zx is None:
            zx = self.project(x)
        if self._z_grey is None:
            self._z_grey = self.project(torch.full((1, x.shape[1]), GREY))
        choices = []
        for base, z_base in ((prev, self.project(prev)), (None, self._z_grey)):
            z = zx - z_base
            ids, q = self._quantise(z)
            r2 = ((x - (GREY if base is None else base)) ** 2).sum(1)
            # ||r - qB||² = ||r||² - ||z||² (outside the basis) + ||z - q||² (inside)
            err = r2 - (z * z).sum(1) + ((z - q) ** 2).sum(1)
            choices.append((ids, err))
        (ids_p, e_p), (ids_g, e_g) = choices
        intra = e_g < e_p
        ids = torch.where(intra & (ids_g > 0), ids_g + self.per_mode, ids_p)
        ids = torch.where(intra & (ids_g == 0), torch.zeros_like(ids), ids)
        return ids, self.reconstruct(ids, prev)

    def reconstruct(self, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """ids [n] and the previous reconstruction [n, d] -> this frame's [n, d] (0..255)."""
        L, half = self.gains.shape[0], self.per_mode
        intra = ids > half
        j = (torch.where(intra, ids - half, ids) - 1).clamp_min(0)
        level, rest = j % L, j // L
        sign, shape = rest % 2, rest // 2
        g = torch.from_numpy(self.gains)[level] * (1 - 2 * sign).to(torch.float32)
        g = torch.where(ids == 0, torch.zeros_like(g), g)
        base = torch.where(intra[:, None], torch.full_like(prev, GREY), prev)
        return (base + (g[:, None] * self._s[shape]) @ self._b).round_().clamp_(0.0, 255.0)


def load_model(spec: TokenizerSpec, patch: int) -> GainShapeModel:
    where = spec.path or spec.name
    if spec.artifact is None:
        raise ValueError(f"{where}: a video-gsvq spec needs an 'artifact' (the model .npz)")
    try:
        with np.load(spec.artifact_path(), allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("basis", "shapes", "gains")}
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{where}: cannot load model {spec.artifact}: {e}") from e
    b, s, g = arrays["basis"], arrays["shapes"], arrays["gains"]
    d = patch * patch * 3
    if b.ndim != 2 or b.shape[1] != d or s.ndim != 2 or s.shape[1] != b.shape[0] or g.ndim != 1:
        raise ValueError(
            f"{where}: model {spec.artifact} must hold basis [D, {d}], shapes [K, D], gains [L]; "
            f"got {list(b.shape)}, {list(s.shape)}, {list(g.shape)}"
        )
    if not all(np.isfinite(a).all() for a in (b, s, g)) or (g <= 0).any():
        raise ValueError(f"{where}: model {spec.artifact} holds NaN, inf or gains <= 0")
    model = GainShapeModel(b, s, g)
    if model.vocab_size != spec.vocab_size:
        raise ValueError(
            f"{where}: the model makes 1 + 4·{s.shape[0]}·{g.shape[0]} = {model.vocab_size} "
            f"ids, vocab_size is {spec.vocab_size}"
        )
    return model


class GainShapeVideoTokenizer(VqVideoTokenizer):
    """kind ``video-gsvq``: ``(size/patch)²`` ids + ``<eof>`` per frame, predicted from the
    previous frame's reconstruction (see the module docstring)."""

    def load_artifact(self) -> None:
        self.model = load_model(self.spec, self.patch)

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of frames in order -> local ids [t, N]."""
        prev = torch.full((self.tokens_per_frame, self.patch * self.patch * 3), GREY)

        def encode(frames: np.ndarray) -> np.ndarray:
            nonlocal prev
            x = torch.from_numpy(patchify(frames, self.patch)).to(torch.float32)
            x = x.reshape(frames.shape[0], self.tokens_per_frame, -1)
            out = np.empty((frames.shape[0], self.tokens_per_frame), dtype=np.int64)
            zx = self.model.project(x)  # one matmul for the batch
            for i in range(frames.shape[0]):
                ids, prev = self.model.step(x[i], prev, zx[i])
                out[i] = ids.numpy()
            return out

        return encode

    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[t, size, size, 3] uint8, a whole clip from its first frame -> ids [t, N]."""
        return self.encoder()(frames)

    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """local ids [t, N] of a clip from its first frame -> uint8 frames [t, S, S, 3]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, self.tokens_per_frame)
        if ids.size and (ids.min() < 0 or ids.max() >= self.model.vocab_size):
            raise ValueError(f"video local id out of range 0..{self.model.vocab_size - 1}")
        prev = torch.full((self.tokens_per_frame, self.patch * self.patch * 3), GREY)
        out = np.empty((ids.shape[0], self.tokens_per_frame, prev.shape[1]), dtype=np.uint8)
        for i in range(ids.shape[0]):
            prev = self.model.reconstruct(torch.from_numpy(ids[i]), prev)
            out[i] = prev.numpy().astype(np.uint8)
        return unpatchify(out.reshape(-1, prev.shape[1]), self.size, self.patch)


# --------------------------------------------------------------------------- fitting
_CHUNK = 8192


def _best_shapes(u: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n], signed correlation [n]) of the codeword with the largest |u·c|."""
    idx = torch.empty(u.shape[0], dtype=torch.int64)
    val = torch.empty(u.shape[0], dtype=torch.float32)
    for s in range(0, u.shape[0], _CHUNK):
        corr = u[s : s + _CHUNK] @ c.t()
        i = corr.abs().argmax(dim=1)
        idx[s : s + _CHUNK] = i
        val[s : s + _CHUNK] = corr.gather(1, i[:, None])[:, 0]
    return idx, val


def spherical_kmeans(u: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """Unit-norm codewords [k, D] maximising Σ max_j |u_i·c_j| (a shape and its negative are
    one codeword: the id carries the sign). ``u`` [n, D] unit rows."""
    n = u.shape[0]
    if n < k:
        raise ValueError(f"{n} training vectors are too few for {k} shapes")
    c = u[torch.randperm(n, generator=gen)[:k]].clone()
    for _ in range(iters):
        idx, val = _best_shapes(u, c)
        sums = torch.zeros_like(c).index_add_(0, idx, u * torch.sign(val)[:, None])
        counts = torch.bincount(idx, minlength=k)
        empty = torch.nonzero(counts == 0).flatten()
        if empty.numel():  # re-seed with the vectors served worst
            sums[empty] = u[torch.argsort(val.abs())[: empty.numel()]]
        c = sums / sums.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return c


def residual_vectors(clips: list[np.ndarray], patch: int, rng: np.random.Generator) -> np.ndarray:
    """Training residuals [n, p·p·3] float32: each patch against mid-grey (a first frame)
    and against the same patch one frame earlier (motion), on the clip's patch grid and
    on one randomly shifted (and mirrored) grid per clip."""
    out: list[np.ndarray] = []
    for clip in clips:
        views = [clip]
        dy, dx = (int(v) for v in rng.integers(1, patch, 2))
        shifted = np.roll(clip, (dy, dx), axis=(1, 2))
        views.append(shifted[:, :, ::-1] if rng.random() < 0.5 else shifted)
        for v in views:
            x = patchify(np.ascontiguousarray(v), patch).astype(np.float32)
            x = x.reshape(v.shape[0], -1, x.shape[1])
            out.append((x - GREY).reshape(-1, x.shape[2]))
            if v.shape[0] > 1:
                out.append((x[1:] - x[:-1]).reshape(-1, x.shape[2]))
    r = np.concatenate(out)
    return r[np.linalg.norm(r, axis=1) > 1.0]  # a patch that did not change teaches nothing


@dataclass
class GainShapeFit:
    model: GainShapeModel
    info: dict[str, float | int]


def fit_gainshape(
    residuals: np.ndarray,
    dims: int,
    shapes: int,
    levels: int,
    seed: int = 0,
    iters: int = 12,
    stages: int = 3,
    max_vectors: int = 200_000,
) -> GainShapeFit:
    """Basis (uncentred PCA of the residuals), shapes (sign-folded spherical k-means, refit
    on the residuals left after 1..stages quantisation steps, as later frames see them)
    and log-spaced gain levels (the gains those steps use, 0.5th..99.9th percentile)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    r = residuals
    if r.shape[0] > max_vectors:
        r = r[np.sort(rng.choice(r.shape[0], max_vectors, replace=False))]
    sub = r[rng.choice(r.shape[0], min(r.shape[0], 40_000), replace=False)].astype(np.float64)
    _, sv, vt = np.linalg.svd(sub, full_matrices=False)
    basis = torch.from_numpy(vt[:dims].astype(np.float32))
    kept = float((sv[:dims] ** 2).sum() / (sv**2).sum())
    z = torch.from_numpy(r) @ basis.t()
    c = spherical_kmeans(z / z.norm(dim=1, keepdim=True).clamp_min(1e-12), shapes, iters, gen)
    gains: list[torch.Tensor] = []
    for _round in range(2):
        layers, gains = [z], []
        cur = z
        for _ in range(stages):  # residuals after each unquantised-gain step
            idx, val = _best_shapes(cur, c)
            gains.append(val.abs())
            cur = cur - val[:, None] * c[idx]
            layers.append(cur)
        allv = torch.cat(layers)
        allv = allv[allv.norm(dim=1) > 1.0]
        pick = torch.randperm(allv.shape[0], generator=gen)[:max_vectors]
        u = allv[pick] / allv[pick].norm(dim=1, keepdim=True)
        c = spherical_kmeans(u, shapes, iters, gen)
    g = torch.cat(gains).numpy()
    g = g[g > 0.5]
    lo, hi = np.percentile(g, [0.5, 99.9])
    levels_arr = np.geomspace(max(lo, 1.0), hi, levels).astype(np.float32)
    model = GainShapeModel(basis.numpy(), c.numpy(), levels_arr)
    info: dict[str, float | int] = {
        "residuals": int(r.shape[0]),
        "basis_energy": round(kept, 4),
        "seed": seed,
    }
    return GainShapeFit(model, info)


def npz_bytes(model: GainShapeModel) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, basis=model.basis, shapes=model.shapes, gains=model.gains)
    return buf.getvalue()
