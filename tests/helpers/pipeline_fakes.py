"""Small fake tokenizers for the pipeline tests (the real ones live in ulysses_mm.tokenize).

They follow the contract of ulysses_mm.tokenize.base and are registered through the
pipeline config's ``tokenizer_kinds`` (so spawned workers and CLI subprocesses find them):

- ``test-lines`` (dna): a text file, one document per non-empty line of ``ACGTN``; any
  other character is a DecodeError naming the line; ``CRASH`` kills the worker process,
  ``RAISE`` raises a RuntimeError (a tokenizer breaking the contract). Params: ``delay_s``
  (sleep per input), ``pid_dir`` (touch ``PID-NAME`` there as an input starts).
- ``test-bytes`` (audio): the file's bytes, one token per byte (``byte % vocab``).
- ``test-frames`` (video): the file's bytes in frames of ``frame_tokens`` tokens, each
  followed by ``<eof>``; optionally interleaved with ``<|audio|>`` runs.

``expected_documents`` computes, independently of the pipeline, what each file should give;
``make_inputs`` and ``write_pipeline`` lay out a small dataset and its pipeline spec,
``files_of`` reads a dataset back whole;
``cut_blocks`` streams documents as blocks cut anywhere, as a streaming tokenizer gives them.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.tokenspace import DOC_END, DOC_START, EOF, TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenBlock, TokenDocument, Tokenizer

HERE = Path(__file__).resolve().parent
KINDS = {
    "test-lines": "pipeline_fakes:LinesTokenizer",
    "test-bytes": "pipeline_fakes:BytesAudioTokenizer",
    "test-frames": "pipeline_fakes:FramesTokenizer",
}
BASES = "ACGTN"


class LinesTokenizer(Tokenizer):
    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        pid_dir = self.spec.params.get("pid_dir")
        if pid_dir:  # which process reads which input, for tests that kill one
            Path(pid_dir, f"{os.getpid()}-{Path(path).name}").touch()
        time.sleep(float(self.spec.params.get("delay_s", 0)))
        text = Path(path).read_text(errors="replace")
        if not text.strip():
            raise DecodeError("empty file")
        r = space.range(self.modality)
        docs = []
        for n, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line:
                continue
            if line == "CRASH":
                os.kill(os.getpid(), signal.SIGKILL)
            if line == "RAISE":
                raise RuntimeError("fake tokenizer bug")
            bad = [c for c in line if c not in BASES]
            if bad:
                raise DecodeError(f"line {n}: illegal character {bad[0]!r}")
            ids = np.frombuffer(line.encode(), np.uint8)
            lut = np.zeros(256, np.int64)
            for i, c in enumerate(BASES):
                lut[ord(c)] = r.start + i
            body = lut[ids]
            toks = np.concatenate(
                [[DOC_START, space.boundary_token(self.modality)], body, [DOC_END]]
            )
            docs.append(TokenDocument(path, f"{path}#{n}", self.modality, toks))
        yield from docs

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> str:
        r = space.range(self.modality)
        t = np.asarray(tokens)
        t = t[(t >= r.start) & (t < r.stop)] - r.start
        return "".join(BASES[i] for i in t)


class BytesAudioTokenizer(Tokenizer):
    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        data = Path(path).read_bytes()
        if not data:
            raise DecodeError("empty file: no audio samples")
        r = space.range(self.modality)
        body = r.start + np.frombuffer(data, np.uint8).astype(np.int64) % self.spec.vocab_size
        toks = np.concatenate([[DOC_START, space.boundary_token(self.modality)], body, [DOC_END]])
        yield TokenDocument(path, path, self.modality, toks)

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> np.ndarray:
        r = space.range(self.modality)
        t = np.asarray(tokens)
        t = t[(t >= r.start) & (t < r.stop)] - r.start
        return (t / max(1, self.spec.vocab_size - 1) * 2 - 1).astype(np.float32)


class FramesTokenizer(Tokenizer):
    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        data = np.frombuffer(Path(path).read_bytes(), np.uint8).astype(np.int64)
        ft = int(self.spec.params.get("frame_tokens", 16))
        if not len(data):
            raise DecodeError("empty file: no video stream")
        if len(data) % ft:
            raise DecodeError(
                f"truncated: {len(data)} bytes is not a whole number of {ft}-token frames"
            )
        r = space.range(self.modality)
        frames = (r.start + data % self.spec.vocab_size).reshape(-1, ft)
        chunk = int(self.spec.params.get("chunk_frames", 0))
        parts: list[np.ndarray] = [np.array([DOC_START, space.boundary_token(self.modality)])]
        for i, f in enumerate(frames):
            parts.append(np.append(f, EOF))
            if chunk and (i + 1) % chunk == 0 and "audio" in space.modalities:
                a = space.range("audio")
                parts.append(
                    np.array([space.boundary_token("audio"), a.start + i % a.size, a.start])
                )
                parts.append(np.array([space.boundary_token(self.modality)]))
        parts.append(np.array([DOC_END]))
        yield TokenDocument(path, path, self.modality, np.concatenate(parts))

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> np.ndarray:
        r = space.range(self.modality)
        ft = int(self.spec.params.get("frame_tokens", 16))
        side = round(ft**0.5)
        t = np.asarray(tokens).astype(np.int64)
        keep = ((t >= r.start) & (t < r.stop)) | (t == EOF)
        t = t[keep]
        frames = []
        for piece in np.split(t, np.flatnonzero(t == EOF) + 1):
            body = piece[piece != EOF]
            if len(piece) and piece[-1] == EOF and len(body) == ft:
                g = ((body - r.start) * 255 // max(1, self.spec.vocab_size - 1)).astype(np.uint8)
                frames.append(np.repeat(g.reshape(side, side, 1), 3, axis=2))
        return np.stack(frames) if frames else np.zeros((0, side, side, 3), np.uint8)


def write_spec(directory: Path, name: str, modality: str, kind: str, vocab: int, **params) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    spec = {"name": name, "modality": modality, "kind": kind, "vocab_size": vocab, "params": params}
    path.write_text(json.dumps(spec))
    return path


def expected_documents(
    path: Path, modality: str, space: TokenSpace, vocab: int, **params
) -> list[np.ndarray]:
    """What the fake of ``modality`` gives for ``path``, computed here without it."""
    r = space.range(modality)
    head = [DOC_START, space.boundary_token(modality)]
    if modality == "dna":
        return [
            np.array(head + [r.start + BASES.index(c) for c in line.strip()] + [DOC_END])
            for line in path.read_text().splitlines()
            if line.strip()
        ]
    data = list(path.read_bytes())
    if modality == "audio":
        return [np.array(head + [r.start + b % vocab for b in data] + [DOC_END])]
    ft = params.get("frame_tokens", 16)
    chunk = params.get("chunk_frames", 0)
    out = list(head)
    for i in range(len(data) // ft):
        out += [r.start + b % vocab for b in data[i * ft : (i + 1) * ft]] + [EOF]
        if chunk and (i + 1) % chunk == 0:
            a = space.range("audio")
            out += [space.boundary_token("audio"), a.start + i % a.size, a.start]
            out += [space.boundary_token(modality)]
    return [np.array(out + [DOC_END])]


VIDEO = {"frame_tokens": 16, "chunk_frames": 3}


def make_inputs(root: Path, n_dna: int = 6, bad: bool = True, seed: int = 0) -> Path:
    """Fake inputs: DNA lines (.seq), audio bytes (.snd), video frames (.vid), and bad ones."""
    rng = np.random.default_rng(seed)
    d = root / "data"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_dna):
        lines = [
            "".join(rng.choice(list("ACGTN"), int(rng.integers(1, 400))))
            for _ in range(int(rng.integers(1, 12)))
        ]
        (d / f"genome{i:02d}.seq").write_text("\n".join(lines) + "\n")
    (d / "speech.snd").write_bytes(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
    (d / "clip.vid").write_bytes(rng.integers(0, 256, 16 * 20, dtype=np.uint8).tobytes())
    if bad:
        (d / "corrupt.seq").write_text("ACGT\nACGXT\n")
        (d / "empty.seq").write_text("")
        (d / "truncated.vid").write_bytes(b"\x01" * 37)
        (d / "notes.txt").write_text("not an input\n")
        (d / "buggy.seq").write_text("RAISE\n")
    return d


def write_pipeline(
    root: Path,
    output: str,
    seq_len: int = 512,
    delay_s: float = 0.0,
    pid_dir: str = "",
    **extra,
) -> Path:
    tok = root / "tok"
    lines = {"delay_s": delay_s, **({"pid_dir": pid_dir} if pid_dir else {})}
    write_spec(tok, "lines", "dna", "test-lines", 5, **lines)
    write_spec(tok, "bytes", "audio", "test-bytes", 256)
    write_spec(tok, "frames", "video", "test-frames", 64, **VIDEO)
    spec: dict[str, Any] = {
        "name": "fake",
        "sources": ["data/*", "missing/*.seq"],
        "tokenizers": ["tok/lines.json", "tok/bytes.json", "tok/frames.json"],
        "suffixes": {"dna": [".seq"], "audio": [".snd"], "video": [".vid"]},
        "tokenizer_kinds": KINDS,
        "pack": {"seq_len": seq_len},
        "shards": {"max_bytes": 20480},
        "output": output,
        "workers": 2,
        "progress": False,
        **extra,
    }
    path = root / "pipeline.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path (partition folders included)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def cut_blocks(
    docs: Sequence[np.ndarray], mods: Sequence[int], cuts: Sequence[int]
) -> Iterator[TokenBlock]:
    """The documents as :class:`TokenBlock` pieces cut at token positions ``cuts``: a
    document split across blocks is left open (``closed=False``) and carried on by the next
    block (``continues``)."""
    tokens = np.concatenate(docs)
    ends = np.cumsum([len(d) for d in docs])
    starts = ends - [len(d) for d in docs]
    for a, b in itertools.pairwise([0, *cuts, len(tokens)]):
        first = int(np.searchsorted(ends, a, side="right"))  # the document holding token a
        last = int(np.searchsorted(ends, b - 1, side="right"))
        lens = [min(ends[d], b) - max(starts[d], a) for d in range(first, last + 1)]
        yield TokenBlock(
            tokens[a:b],
            np.array(lens, np.int64),
            np.array(mods[first : last + 1], np.int64),
            continues=bool(starts[first] < a),
            closed=bool(ends[last] <= b),
        )
