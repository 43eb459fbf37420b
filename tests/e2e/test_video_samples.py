"""A clip longer than a sample, through ``prepare`` with a ``video-h264`` spec: every packed
sample that continues the clip decodes (``inspect``'s decode and ``--png``), and once an
intra refresh sweep has passed its frames are exactly the clip's own."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
from media_factory import smooth_frames, write_video

from ulysses_mm.core.format import SEG_POS
from ulysses_mm.core.tokenspace import EOF
from ulysses_mm.shards.inspect import decode_sample, inspect_dataset, load_sample, open_target
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.video.fidelity import psnr

KEYINT = 8
PARAMS = {"size": 64, "tokens_per_frame": 48, "keyint": KEYINT, "slice_bytes": 64}


def test_every_sample_of_a_long_clip_decodes_to_its_frames(tmp_path: Path) -> None:
    frames = smooth_frames(np.random.default_rng(3), 96, 64, 64)
    (tmp_path / "clips").mkdir()
    write_video(tmp_path / "clips" / "clip.mp4", frames, fps=8)
    spec = tmp_path / "h264.json"
    spec.write_text(
        json.dumps(
            {
                "name": "h264-small",
                "modality": "video",
                "kind": "video-h264",
                "vocab_size": 65792,
                "params": PARAMS,
            }
        )
    )
    out = tmp_path / "out"
    pipeline = {
        "name": "long-clip",
        "sources": ["clips/*.mp4"],
        "tokenizers": [str(spec)],
        "pack": {"seq_len": 1100},  # ~30 frames a sample
        "output": str(out),
        "workers": 1,
        "progress": False,
    }
    (tmp_path / "pipeline.yaml").write_text(json.dumps(pipeline))
    prepare(load_pipeline_config(tmp_path / "pipeline.yaml"))
    m = Manifest.load(str(out))
    assert m.num_samples >= 3

    tok = load_tokenizer(spec)
    (doc,) = tok.encode_file(str(tmp_path / "clips" / "clip.mp4"), m.token_space)
    clean = tok.decode(doc.tokens, m.token_space)  # the whole clip decoded from its start
    shown = 0
    for k in range(1, m.num_samples):  # every sample after the first starts mid-clip
        sample, _ = load_sample(open_target(str(out)), k)
        (video,) = [d for d in decode_sample(m, sample) if d.modality == "video"]
        assert not video.error and video.data.shape[1:] == (64, 64, 3)
        pos = int(sample.segments[0, SEG_POS])
        first = int((doc.tokens[:pos] == EOF).sum()) + 1  # the first whole frame it holds
        n = len(video.data)
        healed = max(0, -(-first // KEYINT) * KEYINT + KEYINT - first)  # next sweep's end
        if healed < n:
            seen = video.data[healed:]
            assert np.array_equal(seen, clean[first + healed : first + n])
            assert psnr(frames[first + healed : first + n], seen) > 26.0
            shown += n - healed
    assert shown >= 30  # the check above ran on real frames

    png = tmp_path / "mid.png"
    assert inspect_dataset(str(out), sample=m.num_samples // 2, png=str(png)) == 0
    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.std() > 0.05
