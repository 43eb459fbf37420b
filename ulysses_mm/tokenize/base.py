"""The contract between modality tokenizers and the pipeline that packs their output.

A tokenizer is described by a JSON spec in ``tokenizers/`` (data, never Python) and built
by :func:`load_tokenizer`. It turns one input file into one or more
:class:`TokenDocument` (a FASTA file with several records gives several), each already in
the unified token space: ``<doc> <|m|> … </doc>``. A document may switch modality with
another ``<|m|>`` (a clip interleaving video and audio). A bad input raises
:class:`DecodeError` with a one-line reason; the pipeline records it and goes on. A bad
spec is a :class:`~ulysses_mm.core.errors.DataError` naming its file, raised when the
tokenizer is built. Kinds check their params with :mod:`ulysses_mm.tokenize.params` and
frame their ids with :mod:`ulysses_mm.tokenize.framing`.

A kind that can read a byte stream (``streams = True``) also gives its documents as
:class:`TokenBlock` pieces through :meth:`Tokenizer.encode_stream`, from a file object
opened on a local file or straight on an object in a bucket: memory is then bounded by
the block, not by the record or the file, and no local copy of the input is made.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np

from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.tokenspace import TokenSpace


class DecodeError(DataError):
    """An input cannot be turned into tokens; ``str(e)`` is the one-line reason."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed ``tokenizers/*.json`` file."""

    name: str
    modality: str
    kind: str  # which implementation: see ulysses_mm.tokenize.registry
    vocab_size: int  # ids this tokenizer uses inside its modality range
    params: dict[str, Any] = field(default_factory=dict)
    artifact: str | None = None  # learned state (e.g. a codebook), relative to the spec
    artifact_sha256: str | None = None
    path: str = ""  # where the spec was read from
    sha256: str = ""  # of the spec file's bytes (recorded in manifests)

    @classmethod
    def load(cls, path: str | Path) -> TokenizerSpec:
        p = Path(path)
        try:
            raw = p.read_bytes()
            data = json.loads(raw)
        except OSError as e:
            raise DataError(f"{p}: cannot read the tokenizer spec: {e.strerror or e}") from e
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: tokenizer spec is not valid JSON: {e}") from e
        required = {"name", "modality", "kind", "vocab_size"}
        allowed = required | {"params", "artifact", "artifact_sha256", "description"}
        if not isinstance(data, dict) or not required <= set(data):
            raise DataError(f"{p}: tokenizer spec needs keys {sorted(required)}")
        unknown = set(data) - allowed
        if unknown:
            raise DataError(
                f"{p}: unknown tokenizer spec keys {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        try:
            vocab_size = int(data["vocab_size"])
        except (TypeError, ValueError):
            vocab = data["vocab_size"]
            raise DataError(f"{p}: 'vocab_size' must be an integer, got {vocab!r}") from None
        params = data.get("params") or {}
        if not isinstance(params, dict):
            raise DataError(f"{p}: 'params' must be a mapping, got {type(params).__name__}")
        spec = cls(
            name=str(data["name"]),
            modality=str(data["modality"]),
            kind=str(data["kind"]),
            vocab_size=vocab_size,
            params=dict(params),
            artifact=data.get("artifact"),
            artifact_sha256=data.get("artifact_sha256"),
            path=str(p),
            sha256=hashlib.sha256(raw).hexdigest(),
        )
        if spec.artifact is not None:
            art = spec.artifact_path()
            if not art.is_file():
                raise DataError(f"{p}: artifact {art} does not exist")
            digest = hashlib.sha256(art.read_bytes()).hexdigest()
            if spec.artifact_sha256 and digest != spec.artifact_sha256:
                raise DataError(
                    f"{p}: artifact {art} has sha256 {digest[:16]}…, the spec expects "
                    f"{spec.artifact_sha256[:16]}…"
                )
        return spec

    @property
    def where(self) -> str:
        """What errors about this spec name: its file, else its name."""
        return self.path or self.name

    def artifact_path(self) -> Path:
        assert self.artifact is not None
        return (Path(self.path).parent / self.artifact).resolve()

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "modality": self.modality,
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "params": self.params,
            "spec_sha256": self.sha256,
            "artifact_sha256": self.artifact_sha256,
        }


@dataclass
class TokenDocument:
    """One document, ready to pack: ids in the unified space from ``<doc>`` to ``</doc>``."""

    source: str  # the input file (path or URL)
    key: str  # stable and unique in a dataset, e.g. "file.fa#chrI"
    modality: str  # the primary modality (the segment table's modality column)
    tokens: np.ndarray  # 1-D integer array


@dataclass
class TokenBlock:
    """Documents of one input, or pieces of them, as a streaming tokenizer gives them.

    Piece ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (``offsets = [0, cumsum(lengths)]``)
    of modality index ``modalities[i]`` (token-space order). With ``continues``, piece 0
    carries on the document the previous block left open; unless ``closed``, the last
    piece's document goes on in the next block. Every other piece is a whole document,
    ``<doc> … </doc>``, so a record longer than a block is given in pieces and no one
    holds it whole."""

    tokens: np.ndarray  # 1-D, the token space's dtype
    lengths: np.ndarray  # int64 [pieces], each >= 1
    modalities: np.ndarray  # int64 [pieces]
    continues: bool = False
    closed: bool = True


class Tokenizer(ABC):
    """Raw file -> token documents, and tokens -> something a person can inspect."""

    # True: encode_stream reads a binary file object (no local copy of a remote input)
    streams: ClassVar[bool] = False

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec

    @property
    def modality(self) -> str:
        return self.spec.modality

    @abstractmethod
    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        """Decode and tokenize one file; raise DecodeError for a bad input."""

    def encode_stream(self, f: IO[bytes], source: str, space: TokenSpace) -> Iterator[TokenBlock]:
        """The documents of the input read from ``f`` (named ``source`` in errors), as
        blocks of bounded size, the same tokens :meth:`encode_file` gives; only for a kind
        with ``streams = True``."""
        raise NotImplementedError(f"tokenizer kind {self.spec.kind!r} does not read streams")

    def companion_specs(self) -> list[TokenizerSpec]:
        """Specs of the other modalities this tokenizer's documents also hold (a video spec
        that interleaves the clip's audio names its audio spec): a token space for data
        from this tokenizer must include their modalities too. Default: none."""
        return []

    @abstractmethod
    def decode(self, tokens: np.ndarray, space: TokenSpace) -> Any:
        """Unified-space ids of this modality (specials allowed) back to data:
        DNA a str, audio a float32 waveform, video uint8 frames [t, h, w, 3]."""


def build_token_space(specs: Sequence[TokenizerSpec]) -> TokenSpace:
    """The dataset's token space from the specs a pipeline names, in that order."""
    vocab: dict[str, int] = {}
    for s in specs:
        if s.modality in vocab:
            raise ConfigError(f"two tokenizer specs for modality {s.modality!r} ({s.path})")
        vocab[s.modality] = s.vocab_size
    return TokenSpace.from_vocab(vocab)


def spec_table(specs: Sequence[TokenizerSpec]) -> Mapping[str, dict[str, Any]]:
    return {s.modality: s.manifest_entry() for s in specs}
