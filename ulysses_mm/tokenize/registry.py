"""From a tokenizer spec to a tokenizer: ``spec.kind`` names the implementation.

``_KINDS`` is the one list of kinds: a line per kind, its class as "module:Class" (a
class in ``tokenize/<modality>/``) and the file endings it reads. The class is imported
on first use (:func:`kind_class`), so asking for a kind's facts (its token names, its
unit) costs only its module.

Each kind is registered with the files it reads, by file-name ending: this is the one
suffix table ``prepare`` routes inputs with (see :func:`ulysses_mm.shards.prepare.route.route`).
Kept here, not in the tokenizer modules, so routing never imports a decoder.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ulysses_mm.core.errors import DataError
from ulysses_mm.tokenize.base import Tokenizer, TokenizerSpec


@dataclass(frozen=True)
class Kind:
    """A tokenizer implementation and the files it reads."""

    target: str  # "module:Class", imported on first use (video needs decord/PyAV, DNA biopython)
    # file-name endings it reads (lower case)
    suffixes: tuple[str, ...] = ()
    # endings it reads only where no tokenizer of the pipeline claims them in ``suffixes``:
    # the audio tokenizer reads a video container's sound track when there is no video one
    fallback_suffixes: tuple[str, ...] = ()
    # a kind with a learned part says how it is fitted: "module:Class" of the dataclass of
    # ``tokenizer fit KIND``'s options, whose ``main()`` fits and writes the spec
    fit: str = ""


_DNA = (".fa", ".fasta", ".fna", ".ffn", ".frn", ".fas", ".fastq", ".fq", ".gb", ".gbk", ".gbff")
_VIDEO = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")
_AUDIO = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac")

_KINDS: dict[str, Kind] = {
    "dna-base": Kind(
        "ulysses_mm.tokenize.dna.tokenizer:DnaTokenizer", _DNA + tuple(s + ".gz" for s in _DNA)
    ),
    "audio-mulaw": Kind(
        "ulysses_mm.tokenize.audio.mulaw:MulawTokenizer",
        _AUDIO,
        fallback_suffixes=(".mp4", ".webm", ".mkv", ".mov", ".m4v"),
    ),
    "audio-codec": Kind(
        "ulysses_mm.tokenize.audio.codec:CodecAudioTokenizer",
        _AUDIO,
        fallback_suffixes=(".mp4", ".webm", ".mkv", ".mov", ".m4v"),
    ),
    "video-vq": Kind(
        "ulysses_mm.tokenize.video.vq:VqVideoTokenizer",
        _VIDEO,
        fit="ulysses_mm.tokenize.video.fit:VideoVqFit",
    ),
    "video-h264": Kind("ulysses_mm.tokenize.video.h264:H264VideoTokenizer", _VIDEO),
    "video-codec": Kind("ulysses_mm.tokenize.video.codec.tokenizer:CodecVideoTokenizer", _VIDEO),
    "text": Kind("ulysses_mm.tokenize.text.tokenizer:TextTokenizer", (".txt", ".jsonl")),
}


def register_kind(
    kind: str,
    target: str | type[Tokenizer],
    suffixes: Sequence[str] = (),
    fallback_suffixes: Sequence[str] = (),
    fit: str = "",
) -> None:
    """Make ``kind`` resolvable; ``target`` is a Tokenizer class or "module:Class".

    A kind registered without suffixes gets its inputs only through a pipeline's own
    ``suffixes`` table; one with ``fit`` can be fitted (see :class:`Kind`)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    _KINDS[kind] = Kind(
        target,
        tuple(s.lower() for s in suffixes),
        tuple(s.lower() for s in fallback_suffixes),
        fit,
    )


def kinds() -> list[str]:
    return sorted(_KINDS)


def fittable() -> dict[str, str]:
    """Each kind that can be fitted, with its fit options ("module:Class")."""
    return {name: k.fit for name, k in sorted(_KINDS.items()) if k.fit}


def kind(name: str) -> Kind:
    """The registration of kind ``name``; ValueError naming the known kinds if none."""
    if name not in _KINDS:
        raise ValueError(f"unknown tokenizer kind {name!r}; known: {kinds()}")
    return _KINDS[name]


def kind_class(name: str) -> type[Tokenizer]:
    """The Tokenizer class of kind ``name``, imported now; ValueError naming the known kinds
    if none. Its classmethods give the kind's facts without loading a tokenizer."""
    module, _, attr = kind(name).target.partition(":")
    cls: type[Tokenizer] = getattr(importlib.import_module(module), attr)
    return cls


def load_tokenizer(spec: TokenizerSpec | str | Path) -> Tokenizer:
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec.load(spec)
    if spec.kind not in _KINDS:
        raise DataError(f"{spec.where}: unknown tokenizer kind {spec.kind!r}; known: {kinds()}")
    return kind_class(spec.kind)(spec)
