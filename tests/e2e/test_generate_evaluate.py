"""``generate`` and ``evaluate`` on the demo's checkpoint (``ulysses-mm demo`` with fewer
steps and shorter samples: every modality, the clip's audio interleaved with its frames).

Each file ``generate`` writes is read back by an independent reader (biopython, soundfile,
PyAV, Python's UTF-8 decoding); the same seed writes the same bytes; an export generates
what its checkpoint does; ``evaluate`` gives the figures the training run's own eval
logged on the same batches, and on windows of any length (``--seq-len``) under any SP
layout (``--sp``) the figures of the same tokens; what a user can get wrong is one line."""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import Counter
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from Bio import SeqIO
from conftest import REPO, require_fixture
from torch.testing import assert_close

from ulysses_mm.cli import main
from ulysses_mm.core.format import IGNORE
from ulysses_mm.loader.batch import samples_batch
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import cut_windows
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.tools import generate
from ulysses_mm.tools.demo import run_demo
from ulysses_mm.train.evaluate import log_edges

DATA = REPO / "tests" / "data"
FRAME = 257  # video-vq-av: 256 ids and <eof>
CHUNK_AUDIO = 8000  # 4 frames at 8 fps: 0.5 s of 16 kHz audio after every 4 frames


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    require_fixture(DATA.is_dir() and any(DATA.glob("*.webm")), "tests/data sample files")
    out = tmp_path_factory.mktemp("demo")
    run_demo(str(out), steps=4, seq_len=1024, eval_batches=6, samples=300)
    (ckpt,) = (out / "run" / "checkpoints").glob("step_00000004")
    return {"out": out, "ckpt": str(ckpt), "manifest": str(out / "shards" / "manifest.json")}


def _generate(capsys, ckpt: str, *args: str) -> str:
    assert main(["generate", ckpt, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _refused(capsys, *args: str) -> str:
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_generate_writes_files_their_readers_open(demo, tmp_path, capsys, monkeypatch):
    ckpt = demo["ckpt"]
    fa, wav, mp4, txt = (tmp_path / f"g.{e}" for e in ("fa", "wav", "mp4", "txt"))
    _generate(
        capsys, ckpt, "--modality", "dna", "--prompt", str(DATA / "human_mt.fa"),
        "--prompt-tokens", "64", "--new-tokens", "120", "--ignore-doc-end", "--out", str(fa),
    )  # fmt: skip
    rec = SeqIO.read(fa, "fasta")
    assert len(rec.seq) == 120 and set(str(rec.seq)) <= set("ACGTNacgtn")

    _generate(
        capsys, ckpt, "--modality", "audio", "--prompt", str(DATA / "ljspeech_LJ001-0001.wav"),
        "--prompt-seconds", "0.05", "--new-tokens", "400", "--ignore-doc-end", "--out", str(wav),
    )  # fmt: skip
    wave, rate = soundfile.read(wav)
    assert rate == 16000 and wave.shape == (400,) and np.abs(wave).max() <= 1.0

    # the prompt ends inside the audio of its first 4 frames (7,000 of its ~0.5 s): the
    # model writes the chunk's last 1,000 samples, then <|video|> and two whole frames
    # (the rest of the ids, a part frame, is dropped)
    prompt = 4 * FRAME + 1 + 7000
    out = _generate(
        capsys, ckpt, "--modality", "video", "--prompt", str(DATA / "rabbit_toy_320x240.webm"),
        "--prompt-tokens", str(prompt), "--new-tokens", str(1000 + 1 + 2 * FRAME + 60),
        "--with-prompt", "--out", str(mp4),
    )  # fmt: skip
    assert "6 frames at 8 fps, 0.50 s of audio" in out, out
    with av.open(str(mp4)) as c:
        kinds = {s.type: s.codec_context.name for s in c.streams}
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(str(mp4)) as c:
        samples = sum(f.samples for f in c.decode(audio=0))
    assert kinds == {"video": "h264", "audio": "aac"}
    assert len(frames) == 6 and frames[0].shape == (256, 256, 3)
    assert samples >= CHUNK_AUDIO

    # text: 40 ids, all of the text range (text-bytes: id - start is the byte), the file
    # their UTF-8 decoding; the same seed samples the same ids, another seed others
    sampled = []
    real = generate._worker

    def worker(payload, trained=None):
        sampled.append(real(payload, trained))
        return sampled[-1]

    monkeypatch.setattr(generate, "_worker", worker)
    args = ["--modality", "text", "--new-tokens", "40", "--ignore-doc-end"]
    again, other = tmp_path / "again.txt", tmp_path / "other.txt"
    _generate(capsys, ckpt, *args, "--seed", "3", "--out", str(txt))
    _generate(capsys, ckpt, *args, "--seed", "3", "--out", str(again))
    _generate(capsys, ckpt, *args, "--seed", "4", "--out", str(other))
    ids, same, changed = (list(s["ids"]) for s in sampled)
    text = Manifest.load(demo["manifest"]).token_space.range("text")
    assert len(ids) == 40 and all(text.start <= i < text.stop for i in ids), ids
    assert same == ids and changed != ids
    want = bytes(i - text.start for i in ids).decode("utf-8", errors="replace")
    assert txt.read_text(encoding="utf-8") == want
    assert again.read_bytes() == txt.read_bytes()


def test_same_seed_same_file_and_an_export_generates_the_same(demo, tmp_path, capsys):
    ckpt = demo["ckpt"]
    args = ["--modality", "dna", "--new-tokens", "80", "--ignore-doc-end", "--top-k", "4"]
    a, b, c, d = (tmp_path / f"{n}.fa" for n in "abcd")
    _generate(capsys, ckpt, *args, "--seed", "1", "--out", str(a))
    _generate(capsys, ckpt, *args, "--seed", "1", "--out", str(b))
    _generate(capsys, ckpt, *args, "--seed", "2", "--out", str(c))
    assert a.read_bytes() == b.read_bytes()
    seq = lambda p: str(SeqIO.read(p, "fasta").seq)  # noqa: E731
    assert seq(a) != seq(c)
    # a prompt prefilled by 2 sequence-parallel processes, its cache split over them
    one, two = tmp_path / "one.fa", tmp_path / "two.fa"
    prompt = ["--prompt", str(DATA / "human_mt.fa"), "--prompt-tokens", "301"]
    _generate(capsys, ckpt, *args, *prompt, "--seed", "1", "--out", str(one))
    out = _generate(capsys, ckpt, *args, *prompt, "--seed", "1", "--nproc", "2", "--out", str(two))
    assert "on cpu × 2" in out and two.read_bytes() == one.read_bytes()
    export = tmp_path / "hf"
    assert main(["export", ckpt, str(export)]) == 0
    assert (export / "tokenizers.json").is_file()
    _generate(capsys, str(export), *args, "--seed", "1", "--out", str(d))
    assert seq(d) == seq(a)


def test_user_errors_are_one_line(demo, tmp_path, capsys):
    ckpt, out = demo["ckpt"], str(tmp_path / "x")
    err = _refused(
        capsys, "generate", ckpt, "--modality", "protein", "--new-tokens", "5", "--out", out
    )
    assert "has no 'protein' modality (its token space: dna, audio, video, text)" in err
    wav = str(DATA / "ljspeech_LJ001-0001.wav")
    err = _refused(
        capsys, "generate", ckpt, "--modality", "dna", "--prompt", wav, "--new-tokens", "5",
        "--out", out,
    )  # fmt: skip
    assert "ljspeech_LJ001-0001.wav" in err and "not FASTA" in err
    err = _refused(capsys, "generate", ckpt, "--modality", "dna", "--new-tokens", "0", "--out", out)
    assert "--new-tokens must be an integer within 1 .. 10**9, got 0" in err
    err = _refused(
        capsys, "generate", ckpt, "--modality", "dna", "--prompt-seconds", "1",
        "--prompt", str(DATA / "human_mt.fa"), "--new-tokens", "5", "--out", out,
    )  # fmt: skip
    assert "--prompt-seconds applies to audio and video" in err
    hf = tmp_path / "hf"
    assert main(["export", ckpt, str(hf)]) == 0
    (hf / "token_space.json").unlink()  # a transformers checkpoint of some other model
    err = _refused(
        capsys, "generate", str(hf), "--modality", "dna", "--new-tokens", "5", "--out", out
    )
    assert "without token_space.json: not an ulysses-mm export" in err
    assert not Path(out).exists()


def test_evaluate_matches_the_training_eval_and_plots_by_position(demo):
    """The demo's ``evaluate`` (``evaluate_checkpoint``, what the CLI runs; every figure in its
    JSON) against the eval its training run logged: the same batches, the same figures."""
    run = Path(demo["out"]) / "run"
    got = json.loads((run / "loss_by_position.json").read_text())
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r for r in rows if r["kind"] == "eval"]
    assert got["batches"] == logged["eval/batches"] == 6 and got["samples"] == 6
    assert_close(got["loss"], logged["eval/loss"])
    mods = got["modalities"]
    assert len(mods) >= 2 and set(mods) <= {"dna", "audio", "video", "text"}
    for m, e in mods.items():
        assert_close(e["nats_per_token"], logged[f"eval/loss/{m}"])
        unit = {"dna": "base", "audio": "sample", "video": "frame", "text": "byte"}[m]
        if f"bits_per_{unit}" in e:
            assert_close(e[f"bits_per_{unit}"], logged[f"eval/bits_per_{unit}/{m}"])
        curve = [[b["lo"], b["hi"], b["nats_per_token"], b["targets"]] for b in e["by_position"]]
        assert_close(curve, logged[f"eval/position/{m}"])
        assert sum(b["targets"] for b in e["by_position"]) == e["targets"]
    png = (run / "loss_by_position.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _bin_targets(result: dict) -> Counter:
    return Counter(
        {
            (m, b["lo"], b["hi"]): b["targets"]
            for m, e in result["modalities"].items()
            for b in e["by_position"]
        }
    )


def test_evaluate_on_windows_of_any_length_under_any_layout(demo, capsys):
    """At the samples' length (1,024) ``--seq-len`` gives the default figures; at 512 the
    same two samples are four windows (the run's SP=2): every target of the whole samples
    but the one at each window's end, each in the bin of its position in its window's
    piece of its document (``data.window_positions: restart``: no position reaches 512,
    where the whole samples' documents go past it)."""
    ckpt, manifest = demo["ckpt"], demo["manifest"]

    def evaluate(*args: str) -> dict:
        assert main(["evaluate", ckpt, manifest, "--json", "--micro-batch", "1", *args]) == 0
        return json.loads(capsys.readouterr().out)

    one = ("--sp", "1", "--nproc", "1")  # another layout than the run's, in this process
    whole = evaluate("--batches", "2", *one)
    assert evaluate("--batches", "2", "--seq-len", "1024", *one) == whole
    half = evaluate("--batches", "4", "--seq-len", "512")
    assert (half["samples"], half["batches"], whole["samples"]) == (4, 4, 2)
    m = Manifest.load(manifest)
    samples = ShardStream(m, 0, 1, 1, StreamOptions().in_order())
    edges, cut, want = log_edges(), Counter(), Counter()

    def bin_of(b, i: int) -> tuple[str, int, int]:
        j = bisect_right(edges, int(b.position_ids[0, i]) + 1) - 1
        return m.token_space.modalities[int(b.label_modality[0, i])], edges[j], edges[j + 1]

    for _ in range(2):
        (sample,) = samples.next_batch()
        b = samples_batch([sample], m.token_space)
        if b.labels[0, 511] != IGNORE:  # the target the window's end takes away
            cut[bin_of(b, 511)] += 1
        for window in cut_windows(sample, 512, "restart"):
            w = samples_batch([window], m.token_space)
            want.update(bin_of(w, i) for i in range(512) if w.labels[0, i] != IGNORE)
    assert cut and _bin_targets(half) == want
    assert sum(want.values()) == sum(_bin_targets(whole).values()) - sum(cut.values())
    # documents longer than a window; in windows every target's position is below 511
    assert max(lo for _, lo, _ in _bin_targets(whole)) > 512
    assert max(hi for _, _, hi in _bin_targets(half)) == 512
    for m_, e in half["modalities"].items():
        assert e["targets"] == whole["modalities"][m_]["targets"] - sum(
            n for (mod, *_), n in cut.items() if mod == m_
        )
    err = _refused(capsys, "evaluate", ckpt, manifest, "--seq-len", "2048")
    assert f"{manifest}: windows of 2048 tokens are longer than its samples of 1024" in err
    err = _refused(capsys, "evaluate", ckpt, manifest, "--sp", "3")
    assert "the 4 query heads" in err


def test_the_training_eval_logs_generated_samples(demo):
    """``logging.samples``: at the eval, one document per modality, in RUN_DIR/samples and
    in the offline W&B run as audio, video and text, beside the loss-by-position chart."""
    run = Path(demo["out"]) / "run"
    files = sorted(p.name for p in (run / "samples").iterdir())
    assert files == [f"step_00000004_{m}" for m in ("audio.wav", "dna.fa", "text.txt", "video.mp4")]
    wave, rate = soundfile.read(run / "samples" / "step_00000004_audio.wav")
    assert rate == 16000 and wave.shape == (300,)
    assert len(SeqIO.read(run / "samples" / "step_00000004_dna.fa", "fasta").seq) == 300
    with av.open(str(run / "samples" / "step_00000004_video.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 1  # 300 ids: one whole frame of 257
    (media,) = (run / "wandb").glob("offline-run-*/files/media")
    kinds = {p.relative_to(media).parts[0] for p in media.rglob("*") if p.is_file()}
    assert {"audio", "videos", "html", "table"} <= kinds
