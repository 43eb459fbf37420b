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

Motion (params ``motion`` = G and ``local`` = r, both 0 by default: the layout above). With
G > 0 the inter base is the previous reconstruction displaced by one global vector per
frame (phase correlation, |v| <= G; edges replicated), spent as the id at position
``t mod N`` of every frame after the first (that patch is the displaced one, uncoded);
with r > 0 each inter id also names one of (2r+1)² displacements around it per patch,
the one whose prediction is closest in luma (every other row, every column; see
:class:`MotionLayout` for the ids). Handheld footage moves a few pixels a frame at 8 fps:
on a held-out clip G = 12, r = 2 with K = 256, L = 9 (vocab 120,458) gains 1.1 dB over
the plain layout (25.7–26.0 against 24.7–24.9 dB). The encoder spends its time in a few
large vectorised operations per frame (one padded buffer, strided views for every
candidate displacement, one quantisation for inter and intra), ≈ 7 ms a frame on one core.

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

from ulysses_mm.tokenize.base import ParamSchema, TokenizerSpec
from ulysses_mm.tokenize.video.vq import VqVideoTokenizer, patchify, unpatchify

GREY = 128.0

_GS_SCHEMA: ParamSchema = {
    **VqVideoTokenizer.schema,
    "motion": ((int,), 0),  # global displacement searched per frame, ± pixels (0: none)
    "local": ((int,), 0),  # per-patch refinement of it, ± pixels (0: none)
}


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
        # numpy's argmax: the same first maximum, an order of magnitude faster on CPU
        best = torch.from_numpy(corr.abs().numpy().argmax(axis=1))
        g = corr.gather(1, best[:, None])[:, 0]
        mag = g.abs().clamp_min(1e-12)
        # nearest level in the log domain; below half the smallest level: keep (id 0)
        level = (mag.log()[:, None] - self._log_g[None, :]).abs().argmin(dim=1)
        sign = (g < 0).to(torch.int64)
        ids = 1 + (best * 2 + sign) * self.gains.shape[0] + level
        keep = mag < 0.5 * float(self.gains[0])
        gq = torch.from_numpy(self.gains)[level] * (1 - 2 * sign).to(torch.float32)
        gq = torch.where(keep, torch.zeros_like(gq), gq)
        q = gq[:, None] * self._s.index_select(0, best)  # index_select: faster than [best]
        return torch.where(keep, torch.zeros_like(ids), ids), q

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Patches [..., d] -> their coordinates in the basis [..., D]."""
        return x @ self._b.t()

    def step(
        self, x: torch.Tensor, prev: torch.Tensor, zx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame's patches [n, d] and the previous reconstruction [n, d] -> (ids [n],
        reconstruction [n, d]): per patch the better of predicting from the previous frame
        (inter) or from mid-grey (intra: a scene cut, fast motion). ``zx``: x projected,
        if the caller has it."""
        if zx is None:
            zx = self.project(x)
        if self._z_grey is None:
            self._z_grey = self.project(torch.full((1, x.shape[1]), GREY))
        n = x.shape[0]
        z = torch.cat([zx - self.project(prev), zx - self._z_grey])  # [2n, D]: inter, intra
        ids2, q2 = self._quantise(z)
        d_p, d_g = x - prev, x - GREY
        r2 = torch.cat([(d_p * d_p).sum(1), (d_g * d_g).sum(1)])
        # ||r - qB||² = ||r||² - ||z||² (outside the basis) + ||z - q||² (inside)
        err = r2 - (z * z).sum(1) + ((z - q2) ** 2).sum(1)
        ids_p, ids_g, q_p, q_g = ids2[:n], ids2[n:], q2[:n], q2[n:]
        use_g = err[n:] < err[:n]
        grey = use_g & (ids_g > 0)
        keep = use_g & (ids_g == 0)  # grey is better but codes nothing: keep the patch
        ids = torch.where(grey, ids_g + self.per_mode, torch.where(keep, 0, ids_p))
        # the reconstruction of these ids (what :meth:`reconstruct` gives), from the
        # quantised vectors at hand
        q = torch.where(grey[:, None], q_g, torch.where(keep[:, None], 0.0, q_p))
        base = prev.masked_fill(grey[:, None], GREY)
        return ids, (base + q @ self._b).round_().clamp_(0.0, 255.0)

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
        return (
            (base + (g[:, None] * self._s.index_select(0, shape)) @ self._b)
            .round_()
            .clamp_(0.0, 255.0)
        )


# --------------------------------------------------------------------------- motion
@dataclass(frozen=True)
class MotionLayout:
    """How motion-compensated prediction lays out the ids (params ``motion``, ``local``).

    With ``motion`` = G > 0, every frame after the first spends the id at position
    ``t mod N`` on the frame's global displacement (one of (2G+1)² ids; that patch is the
    displaced previous frame, uncoded); with ``local`` = r > 0 each inter id also names one
    of C = (2r+1)² displacements around it, chosen per patch by prediction error. Ids:
    inter with offset o: ``o·(1 + 2KL) + j`` (j = 0 keep, else shape/sign/level as in
    the module docstring); intra: ``C·(1 + 2KL) + j - 1``; motion: after both. G = r = 0 is
    the plain layout, 1 + 4KL ids.
    """

    per_mode: int  # 2KL
    motion: int = 0
    local: int = 0

    @property
    def offsets(self) -> list[tuple[int, int]]:
        r = self.local
        return [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)]

    @property
    def inter_block(self) -> int:
        return 1 + self.per_mode

    @property
    def intra_start(self) -> int:
        return len(self.offsets) * self.inter_block

    @property
    def motion_start(self) -> int:
        return self.intra_start + self.per_mode

    @property
    def vocab_size(self) -> int:
        return self.motion_start + ((2 * self.motion + 1) ** 2 if self.motion else 0)


def _luma(img: torch.Tensor) -> torch.Tensor:
    """[..., 3] -> [...]: the channel sum (of integers, so exact in any order; two strided
    adds are faster than a matmul with ones or a reduction over the last dimension)."""
    return img[..., 0] + img[..., 1] + img[..., 2]


def global_motion(a: torch.Tensor, b: torch.Tensor, limit: int) -> tuple[int, int]:
    """The displacement v (|v| <= ``limit`` each way) with ``b[y] ≈ a[y - v]`` for two
    frames' luma [S, S]: phase correlation on every other pixel (Hann-windowed) proposes
    v to 2 pixels; the squared error away from the borders (every third pixel) picks among
    it, its 3×3 neighbours at full resolution and no motion (the first of equals in that
    order: no motion, then row by row)."""
    s = a.shape[0]
    half_a, half_b = a[::2, ::2], b[::2, ::2]  # [S/2, S/2]
    h = half_a.shape[0]
    w2 = _hann2(h)
    cross = (
        torch.fft.rfft2((half_b - half_b.mean()) * w2)
        * torch.fft.rfft2((half_a - half_a.mean()) * w2).conj()
    )
    r = torch.fft.irfft2(cross / cross.abs().clamp_min(1e-6), s=(h, h))  # peak at +v/2
    lim = (limit + 1) // 2
    idx = torch.arange(-lim, lim + 1) % h
    k = int(r.index_select(0, idx).index_select(1, idx).argmax())
    py, px = 2 * (k // (2 * lim + 1) - lim), 2 * (k % (2 * lim + 1) - lim)
    m = limit
    cands = [(0, 0)] + [
        (dy, dx)
        for dy in (py - 1, py, py + 1)
        for dx in (px - 1, px, px + 1)
        if max(abs(dy), abs(dx)) <= limit and (dy, dx) != (0, 0)
    ]
    # every third row and column suffices; luma is integer-valued, so float64 sums are
    # exact and the comparison cannot turn on rounding
    inner = b[m : s - m : 3, m : s - m : 3]
    d = torch.stack([a[m - dy : s - m - dy : 3, m - dx : s - m - dx : 3] for dy, dx in cands])
    d = (d - inner).to(torch.float64)
    err = (d * d).sum(dim=(1, 2))  # [len(cands)]
    return cands[int(err.argmin())]  # argmin: the first of equal minima


_HANN: dict[int, torch.Tensor] = {}


def _hann2(h: int) -> torch.Tensor:
    """A separable Hann window [h, h] (cached: one per frame size)."""
    if h not in _HANN:
        w = torch.hann_window(h, periodic=False)
        _HANN[h] = w[:, None] * w[None, :]
    return _HANN[h]


class MotionCoder:
    """One clip's predictive coder (encoder or decoder): the previous reconstruction and
    the frame counter, the state both sides keep in lockstep."""

    def __init__(self, model: GainShapeModel, layout: MotionLayout, size: int, patch: int):
        self.model, self.layout, self.size, self.patch = model, layout, size, patch
        self.n = (size // patch) ** 2
        self.prev = torch.full((self.n, patch * patch * 3), GREY)
        self.t = 0
        self.plain = layout.motion == 0 and layout.local == 0  # the previous frame as is
        self._window_index: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None  # the padded previous image, reused

    def _padded(self) -> torch.Tensor:
        """The previous reconstruction as an image, edges replicated by motion + local
        (``F.pad(mode="replicate")``'s values): written into one buffer the coder keeps,
        the patches straight into its interior, then the borders from the edge pixels."""
        pad, s, p = self.layout.motion + self.layout.local, self.size, self.patch
        if self._buf is None:
            self._buf = torch.empty(s + 2 * pad, s + 2 * pad, 3)
        img, n = self._buf, s // p
        inner = img[pad : pad + s, pad : pad + s]  # [S, S, 3], a view
        inner.unflatten(0, (n, p)).unflatten(2, (n, p)).permute(0, 2, 1, 3, 4).copy_(
            self.prev.view(n, n, p, p, 3)
        )
        if pad:
            rows = img[pad : pad + s]
            rows[:, :pad] = rows[:, pad : pad + 1]
            rows[:, pad + s :] = rows[:, pad + s - 1 : pad + s]
            img[:pad] = img[pad : pad + 1]
            img[pad + s :] = img[pad + s - 1 : pad + s]
        return img

    def _patch_view(self, img: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
        """The padded previous image displaced by (dy, dx), as a view [n, n, p, p, 3]."""
        pad, p, n = self.layout.motion + self.layout.local, self.patch, self.size // self.patch
        w = img.shape[1]
        return img.as_strided(
            (n, n, p, p, 3),
            (p * w * 3, p * 3, w * 3, 3, 1),
            ((pad - dy) * w + (pad - dx)) * 3,
        )

    def _displaced(self, img: torch.Tensor, g: tuple[int, int], off: torch.Tensor) -> torch.Tensor:
        """Patch i of the previous image displaced by g + offsets[off[i]]: [N, p·p·3]. One
        copy of each patch's window (the patch and ``local`` pixels around it), then one
        gather from it."""
        r, p = self.layout.local, self.patch
        q = p + 2 * r
        if self._window_index is None:  # [C, p·p·3]: offset o's pixels within a window
            ar = torch.arange(p)
            c = torch.arange(3)
            rows = []
            for oy, ox in self.layout.offsets:
                y = (r - oy + ar)[:, None, None]
                x = (r - ox + ar)[None, :, None]
                rows.append(((y * q + x) * 3 + c).reshape(-1))
            self._window_index = torch.stack(rows)
        n, w = self.size // p, img.shape[1]
        pad = self.layout.motion + r
        windows = img.as_strided(
            (n, n, q, q, 3),
            (p * w * 3, p * 3, w * 3, 3, 1),
            ((pad - g[0] - r) * w + (pad - g[1] - r)) * 3,
        ).reshape(self.n, -1)  # [N, q·q·3], a copy
        # index_select: rows of a small table, several times faster than fancy indexing
        return torch.gather(windows, 1, self._window_index.index_select(0, off))

    def _slot(self) -> int | None:
        return self.t % self.n if self.layout.motion and self.t > 0 else None

    def choose_offsets(
        self, luma: torch.Tensor, xl: torch.Tensor, g: tuple[int, int]
    ) -> torch.Tensor:
        """Per patch, the index into ``layout.offsets`` of the displacement (around g) whose
        prediction is closest to the frame in luma: the squared error over every other
        row and every column of the patch (the first of equals). ``luma``: the padded
        previous image's [S + 2·pad, S + 2·pad]; ``xl``: the frame's [S, S]. -> [N]"""
        lay, size, p = self.layout, self.size, self.patch
        if len(lay.offsets) == 1:
            return torch.zeros(self.n, dtype=torch.int64)
        r, pad, w = lay.local, lay.motion + lay.local, luma.shape[1]
        step = 2 if p % 2 == 0 else 1
        h = size // step
        # one strided view [2r+1, 2r+1, S/2, S] of the padded luma holds every offset's
        # rows, in reverse order: element (a, b) is offset (r - a, r - b); the difference
        # goes into a contiguous buffer (else its layout follows the view's strides)
        view = luma.as_strided(
            (2 * r + 1, 2 * r + 1, h, size),
            (w, 1, step * w, 1),
            (pad - g[0] - r) * w + (pad - g[1] - r),
        )
        d = torch.empty(len(lay.offsets), 1, h, size)  # [C, 1, S/2, S]
        torch.sub(view, xl[::step], out=d.view(2 * r + 1, 2 * r + 1, h, size))
        sse = torch.nn.functional.avg_pool2d(d.mul_(d), (p // step, p))  # [C, 1, n, n]
        return sse.reshape(len(lay.offsets), self.n).flip(0).argmin(dim=0)

    def encode(self, x: torch.Tensor, zx: torch.Tensor) -> torch.Tensor:
        """One frame's patches [N, d] (and their projection) -> ids [N]."""
        lay, slot = self.layout, self._slot()
        if self.plain:
            ids, self.prev = self.model.step(x, self.prev, zx)
            self.t += 1
            return ids
        pad, size = lay.motion + lay.local, self.size
        img = self._padded()  # [S + 2·pad, S + 2·pad, 3]
        prev_luma = _luma(img)
        p, n = self.patch, size // self.patch  # the frame's luma [S, S], from its patches
        xl = _luma(x.reshape(n, n, p, p, 3)).permute(0, 2, 1, 3).reshape(size, size)
        g = (0, 0)
        if slot is not None:
            g = global_motion(prev_luma[pad : pad + size, pad : pad + size], xl, lay.motion)
        off = self.choose_offsets(prev_luma, xl, g)
        ids, rec = self.model.step(x, self._displaced(img, g, off), zx)
        out = torch.where(
            ids > lay.per_mode,
            ids - 1 - lay.per_mode + lay.intra_start,
            ids + off * lay.inter_block,
        )
        if slot is not None:
            out[slot] = (
                lay.motion_start + (g[0] + lay.motion) * (2 * lay.motion + 1) + g[1] + lay.motion
            )
            # the slot: the displaced patch, uncoded
            rec[slot] = self._patch_view(img, g[0], g[1])[slot // n, slot % n].reshape(-1)
        self.prev, self.t = rec, self.t + 1
        return out

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """One frame's ids [N] -> its reconstruction [N, d] (0..255)."""
        lay, slot = self.layout, self._slot()
        if self.plain:
            self.prev = self.model.reconstruct(ids, self.prev)
            self.t += 1
            return self.prev
        g = (0, 0)
        if slot is not None:
            m = int(ids[slot]) - lay.motion_start
            if not 0 <= m < (2 * lay.motion + 1) ** 2:
                raise ValueError(
                    f"frame {self.t}: id {int(ids[slot])} at {slot} is not a motion id"
                )
            g = (m // (2 * lay.motion + 1) - lay.motion, m % (2 * lay.motion + 1) - lay.motion)
            ids = ids.clone()
            ids[slot] = 0
        if bool((ids >= lay.motion_start).any()):
            raise ValueError(f"frame {self.t}: a motion id outside the frame's motion slot")
        img = self._padded()
        intra = ids >= lay.intra_start
        off = torch.where(intra, len(lay.offsets) // 2, ids // lay.inter_block)
        plain = torch.where(intra, ids - lay.intra_start + 1 + lay.per_mode, ids % lay.inter_block)
        rec = self.model.reconstruct(plain, self._displaced(img, g, off))
        if slot is not None:
            n = self.size // self.patch
            rec[slot] = self._patch_view(img, g[0], g[1])[slot // n, slot % n].reshape(-1)
        self.prev, self.t = rec, self.t + 1
        return rec


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
    return GainShapeModel(b, s, g)


class GainShapeVideoTokenizer(VqVideoTokenizer):
    """kind ``video-gsvq``: ``(size/patch)²`` ids + ``<eof>`` per frame, predicted from the
    previous frame's reconstruction (see the module docstring)."""

    schema = _GS_SCHEMA

    def load_artifact(self) -> None:
        where = self.spec.path or self.spec.name
        self.model = load_model(self.spec, self.patch)
        motion, local = self.params["motion"], self.params["local"]
        if not 0 <= motion <= self.size // 4 or not 0 <= local <= 3:
            raise ValueError(f"{where}: params 'motion' must be 0..size/4 and 'local' 0..3")
        self.layout = MotionLayout(self.model.per_mode, motion, local)
        if self.layout.vocab_size != self.spec.vocab_size:
            k, levels = self.model.shapes.shape[0], self.model.gains.shape[0]
            raise ValueError(
                f"{where}: the model (K={k} shapes, L={levels} levels, motion {motion}, local "
                f"{local}) makes {self.layout.vocab_size} ids, vocab_size is "
                f"{self.spec.vocab_size}"
            )

    def coder(self) -> MotionCoder:
        return MotionCoder(self.model, self.layout, self.size, self.patch)

    def encoder(self) -> Callable[[np.ndarray], np.ndarray]:
        """A per-clip encoder: batches of frames in order -> local ids [t, N]."""
        coder = self.coder()

        def encode(frames: np.ndarray) -> np.ndarray:
            x8 = torch.from_numpy(patchify(frames, self.patch))
            x8 = x8.reshape(frames.shape[0], self.tokens_per_frame, -1)  # uint8
            out = np.empty((frames.shape[0], self.tokens_per_frame), dtype=np.int64)
            for i in range(frames.shape[0]):
                # frame by frame: a whole batch's intermediates would not stay in cache
                x = x8[i].to(torch.float32)
                out[i] = coder.encode(x, self.model.project(x)).numpy()
            return out

        return encode

    def encode_frames(self, frames: np.ndarray) -> np.ndarray:
        """[t, size, size, 3] uint8, a whole clip from its first frame -> ids [t, N]."""
        return self.encoder()(frames)

    def decode_ids(self, ids: np.ndarray) -> np.ndarray:
        """local ids [t, N] of a clip from its first frame -> uint8 frames [t, S, S, 3]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1, self.tokens_per_frame)
        if ids.size and (ids.min() < 0 or ids.max() >= self.layout.vocab_size):
            raise ValueError(f"video local id out of range 0..{self.layout.vocab_size - 1}")
        coder = self.coder()
        d = self.patch * self.patch * 3
        out = np.empty((ids.shape[0], self.tokens_per_frame, d), dtype=np.uint8)
        for i in range(ids.shape[0]):
            out[i] = coder.decode(torch.from_numpy(ids[i])).numpy().astype(np.uint8)
        return unpatchify(out.reshape(-1, d), self.size, self.patch)


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
