"""Small real inputs made in the test: sequences, tones, and clips encoded with PyAV.

Everything is written by the real encoders (Biopython for sequences, FFmpeg through PyAV
for audio and video), so the tokenizers are tested on genuine files, only small ones.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TEST_DATA = Path(__file__).resolve().parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]
TOKENIZERS = REPO / "tokenizers"


# --------------------------------------------------------------------------- DNA
def random_dna(rng: np.random.Generator, n: int, letters: str = "ACGT") -> str:
    return "".join(np.array(list(letters))[rng.integers(0, len(letters), n)])


def soft_mask(rng: np.random.Generator, seq: str, runs: int = 3) -> str:
    """Lowercase a few random runs, as RepeatMasker output has."""
    s = list(seq)
    for _ in range(runs):
        a = int(rng.integers(0, max(1, len(s) - 1)))
        b = min(len(s), a + int(rng.integers(1, 40)))
        s[a:b] = [c.lower() for c in s[a:b]]
    return "".join(s)


def write_fasta(path: Path, records: list[tuple[str, str]], width: int = 60) -> Path:
    lines = []
    for rid, seq in records:
        lines.append(f">{rid} generated record")
        lines += [seq[i : i + width] for i in range(0, len(seq), width)] or [""]
    _write_text(path, "\n".join(lines) + "\n")
    return path


def write_fastq(path: Path, records: list[tuple[str, str]], width: int | None = None) -> Path:
    """FASTQ; with ``width`` the sequence and quality lines are wrapped (old 454 style)."""
    out = []
    for rid, seq in records:
        qual = "".join(chr(33 + (i % 40)) for i in range(len(seq)))
        w = width or max(1, len(seq))
        out.append(f"@{rid}")
        out += [seq[i : i + w] for i in range(0, len(seq), w)]
        out.append("+")
        out += [qual[i : i + w] for i in range(0, len(qual), w)]
    _write_text(path, "\n".join(out) + "\n")
    return path


def write_genbank(path: Path, records: list[tuple[str, str]]) -> Path:
    import io

    from Bio import SeqIO
    from Bio.Seq import Seq
    from Bio.SeqRecord import SeqRecord

    recs = [
        SeqRecord(Seq(seq), id=rid, name=rid[:16], annotations={"molecule_type": "DNA"})
        for rid, seq in records
    ]
    buf = io.StringIO()
    SeqIO.write(recs, buf, "genbank")
    _write_text(path, buf.getvalue())
    return path


def _write_text(path: Path, text: str) -> None:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


# --------------------------------------------------------------------------- audio
def tone(seconds: float, rate: int, freq: float = 440.0, amp: float = 0.99) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_audio(path: Path, samples: np.ndarray, rate: int) -> Path:
    """``samples`` [n] or [n, channels] float in [-1, 1] -> wav (16-bit PCM), flac,
    ogg (Vorbis) or mp3 by suffix, encoded by FFmpeg through PyAV."""
    import av

    codecs = {".wav": "pcm_s16le", ".flac": "flac", ".ogg": "vorbis", ".mp3": "libmp3lame"}
    data = np.asarray(samples, dtype=np.float32).reshape(len(samples), -1).T  # [ch, n]
    layout = "mono" if data.shape[0] == 1 else "stereo"
    options = {"strict": "experimental"} if path.suffix == ".ogg" else {}  # native vorbis
    with av.open(str(path), "w") as c:
        stream = c.add_stream(codecs[path.suffix], rate=rate, options=options)
        stream.layout = layout
        to_codec = av.AudioResampler(
            format=stream.codec_context.format.name, layout=layout, rate=rate
        )
        step = stream.codec_context.frame_size or 1024
        for i in range(0, data.shape[1], step):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(data[:, i : i + step]), format="fltp", layout=layout
            )
            frame.sample_rate, frame.pts = rate, i
            for f in to_codec.resample(frame):
                for packet in stream.encode(f):
                    c.mux(packet)
        for f in to_codec.resample(None):
            for packet in stream.encode(f):
                c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return path


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - x.astype(np.float64)) ** 2)))


# --------------------------------------------------------------------------- video
def index_frame(i: int, height: int = 96, width: int = 128, bits: int = 8) -> np.ndarray:
    """A frame whose content encodes ``i``: ``bits`` black/white vertical bars across the
    central square (so a centre crop keeps them), on a mid-grey background."""
    f = np.full((height, width, 3), 128, dtype=np.uint8)
    x0 = (width - height) // 2
    bar = height // bits
    for b in range(bits):
        f[:, x0 + b * bar : x0 + (b + 1) * bar] = 255 if (i >> b) & 1 else 0
    return f


def read_index(frame: np.ndarray, bits: int = 8) -> int:
    """Inverse of :func:`index_frame` on a square centre crop of any size."""
    s = frame.shape[1]
    bar = s / bits
    row = frame[frame.shape[0] // 2].mean(axis=-1)
    return sum(1 << b for b in range(bits) if row[int((b + 0.5) * bar)] > 128)


def smooth_frames(
    rng: np.random.Generator, t: int, height: int = 96, width: int = 128
) -> np.ndarray:
    """Natural-ish frames: blurred coloured blobs orbiting inside the frame (VQ-able, unlike
    white noise; any stretch of the clip shows the same kind of content)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    centres = rng.uniform([0.3 * height, 0.3 * width], [0.7 * height, 0.7 * width], size=(4, 2))
    radius = rng.uniform(10, 30, size=(4, 1))
    speed = rng.uniform(0.05, 0.2, size=(4, 1))
    phase = rng.uniform(0, 2 * np.pi, size=(4, 1))
    colours = rng.uniform(30, 230, size=(4, 3))
    for k in range(t):
        a = phase + speed * k
        pos = centres + radius * np.concatenate([np.sin(a), np.cos(a)], axis=1)
        img = np.full((height, width, 3), 60.0, dtype=np.float32)
        for (cy, cx), col in zip(pos, colours):
            w = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * 12.0**2))[..., None]
            img = img * (1 - w) + col * w
        out[k] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def texture(rng: np.random.Generator, height: int, width: int, slope: float = 1.0) -> np.ndarray:
    """A colour image whose amplitude spectrum falls as 1/f^slope (natural images: ~1),
    float [height, width, 3] around a random mean colour."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    f = np.sqrt(fy**2 + fx**2)
    f[0, 0] = 1.0
    amp = 1.0 / f**slope
    shape = (height, width // 2 + 1)
    shared = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    out = np.empty((height, width, 3))
    for c in range(3):  # channels share most of their structure, as in photographs
        own = rng.normal(size=shape) + 1j * rng.normal(size=shape)
        img = np.fft.irfft2((0.7 * shared + 0.3 * own) * amp, s=(height, width))
        out[..., c] = (img - img.mean()) / (img.std() + 1e-9)
    return np.clip(rng.uniform(60, 190, 3) + 45 * out, 0, 255)


def _sample(img: np.ndarray, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Bilinear samples of ``img`` [h, w, 3] at float coordinates (kept inside)."""
    ys = np.clip(ys, 0, img.shape[0] - 1.001)
    xs = np.clip(xs, 0, img.shape[1] - 1.001)
    y0, x0 = ys.astype(np.int64), xs.astype(np.int64)
    fy, fx = (ys - y0)[..., None], (xs - x0)[..., None]
    top = img[y0, x0] * (1 - fx) + img[y0, x0 + 1] * fx
    bottom = img[y0 + 1, x0] * (1 - fx) + img[y0 + 1, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def _sensor(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    return np.clip(img + rng.normal(0, 2.0, img.shape), 0, 255).astype(np.uint8)


def pan_frames(rng: np.random.Generator, t: int, height: int = 240, width: int = 320) -> np.ndarray:
    """A hand-held pan across a textured scene: steady sideways motion, a slow random
    drift and a per-frame shake, all sub-pixel; a little sensor noise."""
    scene = texture(rng, height + 200, width + 4 * t + 200)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    speed = rng.uniform(1.5, 3.0)
    drift = np.cumsum(rng.normal(0, 0.6, (t, 2)), axis=0)
    shake = rng.normal(0, 0.8, (t, 2))
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        dy = 100 + np.clip(drift[k, 0] + shake[k, 0], -90, 90)
        dx = 100 + speed * k + drift[k, 1] + shake[k, 1]
        out[k] = _sensor(rng, _sample(scene, yy + dy, xx + dx))
    return out


def cut_frames(rng: np.random.Generator, t: int, height: int = 240, width: int = 320) -> np.ndarray:
    """Two scenes and a hard cut halfway: a hand-held pan, then another textured scene
    under a slow zoom."""
    first = pan_frames(rng, t // 2, height, width)
    scene = texture(rng, 2 * height, 2 * width)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    second = np.empty((t - t // 2, height, width, 3), dtype=np.uint8)
    for k in range(len(second)):
        s = 1.5 - 0.004 * k
        second[k] = _sensor(
            rng, _sample(scene, (yy - height / 2) * s + height, (xx - width / 2) * s + width)
        )
    return np.concatenate([first, second])


def talking_head_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """A static shot of a talking head: a still textured background, a shaded face that
    sways a little, blinks, and moves its mouth; a little sensor noise."""
    background = texture(rng, height, width, slope=1.3) * 0.8
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    skin = np.array([rng.uniform(170, 220), rng.uniform(120, 160), rng.uniform(90, 130)])
    shirt = rng.uniform(20, 200, 3)
    mouth = np.clip(np.convolve(rng.uniform(-1, 2, t + 8), np.ones(5) / 5, "same")[:t], 0, 1)
    blink = np.zeros(t, dtype=bool)
    blink[rng.choice(t, max(1, t // 50), replace=False)] = True
    sway = np.cumsum(rng.normal(0, 0.15, (t, 2)), axis=0)
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        cy, cx = 0.42 * height + sway[k, 0], 0.5 * width + sway[k, 1]
        img = background.copy()
        img[((xx - cx) / (0.45 * width)) ** 2 + ((yy - height) / (0.35 * height)) ** 2 < 1] = shirt
        head = ((xx - cx) / (0.16 * width)) ** 2 + ((yy - cy) / (0.28 * height)) ** 2
        shade = np.clip(1.1 - 0.35 * head, 0.6, 1.1)[..., None]
        img = np.where((head < 1)[..., None], skin * shade, img)
        img[(head < 1.05) & (yy < cy - 0.15 * height)] = (40, 30, 25)  # hair
        eye_h = 0.012 * height * (0.15 if blink[k] else 1.0)
        for ex in (-0.06, 0.06):
            eye = ((xx - cx - ex * width) / (0.022 * width)) ** 2 + (
                (yy - cy + 0.03 * height) / eye_h
            ) ** 2
            img[eye < 1] = (30, 30, 40)
        mouth_h = 0.005 * height + 0.03 * height * mouth[k]
        lips = ((xx - cx) / (0.05 * width)) ** 2 + ((yy - cy - 0.14 * height) / mouth_h) ** 2
        img[lips < 1] = (110, 40, 45)
        out[k] = _sensor(rng, img)
    return out


def zoom_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """A slow zoom into a textured scene with blurred blobs orbiting over it."""
    scene = texture(rng, 2 * height, 2 * width, slope=1.2)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    centres = rng.uniform([0.3 * height, 0.3 * width], [0.7 * height, 0.7 * width], (3, 2))
    colours = rng.uniform(30, 230, (3, 3))
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        s = 1.0 + 0.003 * k
        img = _sample(scene, (yy - height / 2) / s + height, (xx - width / 2) / s + width)
        for j in range(3):
            a = 0.08 * k + j
            py, px = centres[j, 0] + 30 * np.sin(a), centres[j, 1] + 30 * np.cos(a)
            w = np.exp(-((yy - py) ** 2 + (xx - px) ** 2) / (2 * 15.0**2))[..., None]
            img = img * (1 - w) + colours[j] * w
        out[k] = _sensor(rng, img)
    return out


def _shot_noise(rng: np.random.Generator, img: np.ndarray, read: float = 1.5) -> np.ndarray:
    """A camera sensor's noise: photon shot noise (variance rising with the signal) and read
    noise, on a linear-light image in [0, 255]."""
    sigma = np.sqrt(read**2 + 0.04 * np.clip(img, 0, 255))
    return np.clip(img + rng.normal(0, 1, img.shape) * sigma, 0, 255).astype(np.uint8)


def _blur(img: np.ndarray, radius: float) -> np.ndarray:
    """A Gaussian blur of [h, w, 3] (per channel, in the frequency domain; wraps around)."""
    h, w = img.shape[:2]
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    g = np.exp(-2 * (np.pi * radius) ** 2 * (fy**2 + fx**2))[..., None]
    return np.fft.irfft2(np.fft.rfft2(img, axes=(0, 1)) * g, s=(h, w), axes=(0, 1))


def _ball(
    yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, r: float, colour: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(coverage [h, w, 1] with an anti-aliased edge, shaded colour [h, w, 3]) of a sphere
    lit from the upper left: Lambertian shading and a specular highlight."""
    dy, dx = (yy - cy) / r, (xx - cx) / r
    d2 = dy**2 + dx**2
    cover = np.clip((1 - np.sqrt(d2)) * r + 0.5, 0, 1)[..., None]
    nz = np.sqrt(np.clip(1 - d2, 0, 1))
    light = np.clip(-0.45 * dx - 0.55 * dy + 0.7 * nz, 0, 1)
    spec = np.clip(-0.45 * dx - 0.55 * dy + 0.7 * nz, 0, 1) ** 24
    shade = colour * (0.18 + 0.82 * light[..., None]) + 230 * spec[..., None]
    return cover, shade


def dolly_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """A slow dolly forward through layers at three depths: a smooth sky-to-ground gradient
    far away, a textured middle ground, near posts that grow and slide out of the frame
    (parallax); a little sensor noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    top, bottom = rng.uniform(120, 230, 3), rng.uniform(40, 140, 3)
    far = top + (bottom - top) * (yy / height)[..., None]
    mid = texture(rng, 2 * height, 2 * width, slope=1.4)
    band = 0.55 * height + 0.12 * height * np.sin(xx / width * 3 + rng.uniform(0, 6))
    posts = [
        (rng.uniform(0.1, 0.9) * width, rng.uniform(10, 22), rng.uniform(40, 200, 3))
        for _ in range(4)
    ]
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        s_mid, s_near = 1.0 + 0.004 * k, 1.0 + 0.012 * k
        img = far.copy()
        m = _sample(mid, (yy - height / 2) / s_mid + height, (xx - width / 2) / s_mid + width)
        hor = height / 2 + (band - height / 2) * s_mid
        w = np.clip(yy - hor + 0.5, 0, 1)[..., None]
        img = img * (1 - w) + m * w
        for px, pw, colour in posts:
            x = width / 2 + (px - width / 2) * s_near
            half = pw * s_near / 2
            cover = np.clip(half - np.abs(xx - x) + 0.5, 0, 1)[..., None]
            shade = (
                colour
                * (0.6 + 0.4 * np.clip((xx - x) / max(half, 1) * -0.5 + 0.5, 0, 1))[..., None]
            )
            img = img * (1 - cover) + shade * cover
        out[k] = _sensor(rng, img)
    return out


def gradient_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """Noise-free smooth shading: a lit wall (a slow colour gradient and a vignette) with
    shaded balls gliding over it and a soft shadow under each; no texture, no noise (where
    a coder's banding and blocking show)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    a, b = rng.uniform(60, 200, 3), rng.uniform(60, 200, 3)
    ramp = (0.6 * xx / width + 0.4 * yy / height)[..., None]
    vignette = 1 - 0.35 * (((xx - width / 2) / width) ** 2 + ((yy - height / 2) / height) ** 2)
    wall = (a + (b - a) * ramp) * vignette[..., None]
    balls = [
        (
            rng.uniform(0.2, 0.8, 2) * (height, width),
            rng.uniform(-1.5, 1.5, 2),
            rng.uniform(14, 34),
            rng.uniform(40, 220, 3),
        )
        for _ in range(3)
    ]
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        img = wall.copy()
        for (cy, cx), (vy, vx), r, colour in balls:
            y = height / 2 + (cy + vy * k - height / 2 + height) % (2 * height) - height
            x = (cx + vx * k) % (width + 2 * r) - r
            y = np.clip(y, r, height - r)
            shadow = np.exp(
                -(
                    (yy - y - 0.9 * r) ** 2 / (0.3 * r) ** 2
                    + (xx - x - 0.4 * r) ** 2 / (1.1 * r) ** 2
                )
            )[..., None]
            img = img * (1 - 0.45 * shadow)
            cover, shade = _ball(yy, xx, y, x, r, colour)
            img = img * (1 - cover) + shade * cover
        out[k] = np.clip(np.round(img), 0, 255).astype(np.uint8)
    return out


def photo() -> np.ndarray:
    """A photograph shipped with matplotlib (Grace Hopper's portrait, 600x512), float."""
    from matplotlib import cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float64)


def photo_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """A hand-held camera over a real photograph: a slow pan and zoom, shake, the blur of
    that motion within the exposure, lens softness, and a sensor's shot and read noise."""
    img = _blur(photo(), 0.6)
    h, w = img.shape[:2]
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    drift = np.cumsum(rng.normal(0, 0.4, (t, 2)), axis=0)
    shake = np.convolve(rng.normal(0, 1.0, t + 4), np.ones(3) / 3, "same")[:t]
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        frac = k / max(t - 1, 1)
        scale = (0.95 - 0.25 * frac) * w / width  # scene pixels per output pixel
        cy = 0.35 * h + 0.3 * h * frac + drift[k, 0]
        cx = 0.5 * w + 0.08 * w * np.sin(2 * np.pi * frac) + drift[k, 1]
        acc = np.zeros((height, width, 3))
        for sub in (-0.5, 0.0, 0.5):  # the exposure: three instants of the motion
            dy = cy + shake[k] * (1 + sub) + 0.4 * sub
            dx = cx + shake[k] * sub + 1.2 * sub
            acc += _sample(img, (yy - height / 2) * scale + dy, (xx - width / 2) * scale + dx)
        out[k] = _shot_noise(rng, acc / 3)
    return out


def room_frames(
    rng: np.random.Generator, t: int, height: int = 240, width: int = 320
) -> np.ndarray:
    """A rendered room: a lit wall (smooth gradient, vignette), a textured floor in
    perspective, shaded balls that roll, bounce and pass in front of one another with
    shadows and motion blur, a slowly swaying camera; a sensor's shot and read noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    floor_tex = texture(rng, 256, 256, slope=1.6) * 0.7 + 40
    wall_colour = rng.uniform(150, 220, 3)
    balls = [
        (
            rng.uniform(0.15, 0.85),
            rng.uniform(-0.012, 0.012),
            rng.uniform(0.2, 1.0),
            rng.uniform(0, 6),
            rng.uniform(12, 30),
            rng.uniform(40, 220, 3),
        )
        for _ in range(4)
    ]
    out = np.empty((t, height, width, 3), dtype=np.uint8)
    for k in range(t):
        acc = np.zeros((height, width, 3))
        for sub in (-0.33, 0.0, 0.33):
            time_ = k + sub
            sway_x = 6 * np.sin(0.03 * time_) + 1.5 * np.sin(0.21 * time_)
            sway_y = 3 * np.sin(0.023 * time_ + 1)
            horizon = 0.45 * height + sway_y
            gx = xx + sway_x
            light = 1 - 0.5 * (
                ((gx - 0.3 * width) / width) ** 2 + ((yy - 0.1 * height) / height) ** 2
            )
            img = wall_colour * light[..., None] * (0.85 + 0.15 * yy / height)[..., None]
            depth = np.clip(yy - horizon, 1e-3, None)
            u = (gx - width / 2) / depth * 40
            v = 4000 / depth
            fl = _sample(floor_tex, np.mod(v, 255), np.mod(u + 128, 255))
            haze = np.clip(depth / (0.3 * (height - horizon)), 0, 1)[..., None]  # no aliasing
            fl = (fl * haze + floor_tex.mean((0, 1)) * (1 - haze)) * light[..., None]
            img = np.where((yy > horizon)[..., None], fl, img)
            drawn = []
            for bx, vx, bounce, phase, r, colour in balls:
                x = (bx + vx * time_) % 1.2 - 0.1
                z = 0.5 + 0.5 * np.sin(0.05 * time_ + phase)  # near (1) to far (0)
                rr = r * (0.6 + 0.6 * z)
                ground = horizon + (height - horizon) * (0.25 + 0.7 * z)
                hop = abs(np.sin(0.15 * time_ + phase)) * 40 * bounce * (0.6 + 0.6 * z)
                drawn.append((z, x * width - sway_x, ground - rr - hop, rr, ground, colour))
            for _z, x, y, rr, ground, colour in sorted(drawn, key=lambda d: d[0]):
                shadow = np.exp(-((yy - ground) ** 2 / (0.25 * rr) ** 2 + (xx - x) ** 2 / rr**2))
                img = img * (1 - 0.5 * shadow[..., None])
                cover, shade = _ball(yy, xx, y, x, rr, colour)
                img = img * (1 - cover) + shade * cover
            acc += img
        out[k] = _shot_noise(rng, acc / 3)
    return out


# name -> (generator, seed): the synthetic clips the video benchmarks report on; video-h264's
# params were chosen on ``zoom``, ``dolly`` and ``gradient``, the others are held out
# (``photo`` and ``room`` made to look more like camera footage)
SCENES = {
    "pan": (pan_frames, 11),
    "cut": (cut_frames, 12),
    "talking_head": (talking_head_frames, 13),
    "zoom": (zoom_frames, 14),
    "dolly": (dolly_frames, 15),
    "gradient": (gradient_frames, 16),
    "photo": (photo_frames, 17),
    "room": (room_frames, 18),
}


def write_scene(
    path: Path, name: str, seconds: float = 10.0, fps: int = 24, height: int = 240, width: int = 320
) -> Path:
    """One of :data:`SCENES` as an H.264 file (``seconds`` at ``fps``)."""
    make, seed = SCENES[name]
    frames = make(np.random.default_rng(seed), round(seconds * fps), height, width)
    return write_video(path, frames, fps=fps)


def write_video(
    path: Path,
    frames: np.ndarray,
    fps: int = 30,
    codec: str | None = None,
    audio: np.ndarray | None = None,
    audio_rate: int = 48000,
) -> Path:
    """Encode ``frames`` [t, h, w, 3] uint8 (and optional mono float audio) with PyAV.

    mp4: H.264 (+ AAC), moov at the front; webm: VP9 (+ Opus); mkv with codec "libsvtav1": AV1.
    """
    import av

    suffix = path.suffix
    codec = codec or {".mp4": "libx264", ".webm": "libvpx-vp9", ".mkv": "libx264"}[suffix]
    options = {"movflags": "+faststart"} if suffix == ".mp4" else {}
    with av.open(str(path), "w", options=options) as c:
        vs = c.add_stream(codec, rate=fps)
        vs.width, vs.height = frames.shape[2], frames.shape[1]
        vs.pix_fmt = "yuv420p"
        if codec == "libx264":
            vs.options = {"crf": "12", "preset": "veryfast"}
        elif codec == "libvpx-vp9":
            vs.options = {"crf": "20", "b": "0", "deadline": "realtime", "cpu-used": "8"}
        astream = None
        if audio is not None:
            acodec = "aac" if suffix in (".mp4", ".mkv") else "libopus"
            astream = c.add_stream(acodec, rate=audio_rate)
            astream.layout = "mono"
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts = i
            for p in vs.encode(frame):
                c.mux(p)
        for p in vs.encode(None):
            c.mux(p)
        if astream is not None and audio is not None:
            fs = 960 if astream.codec_context.name == "libopus" else 1024
            fmt = astream.codec_context.format.name
            pts = 0
            for s in range(0, len(audio), fs):
                chunk = audio[s : s + fs]
                if len(chunk) < fs:
                    chunk = np.pad(chunk, (0, fs - len(chunk)))
                arr = chunk[None, :].astype(np.float32)
                af = av.AudioFrame.from_ndarray(arr, format="fltp", layout="mono")
                af.sample_rate = audio_rate
                af.pts = pts
                pts += fs
                if fmt != "fltp":
                    af = av.AudioResampler(format=fmt, layout="mono", rate=audio_rate).resample(af)[
                        0
                    ]
                for p in astream.encode(af):
                    c.mux(p)
            for p in astream.encode(None):
                c.mux(p)
    return path
