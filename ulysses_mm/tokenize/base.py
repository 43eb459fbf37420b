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

The contract is wide enough that nothing outside a modality's package asks which kind it
holds (``tokenize/<modality>/`` holds everything its kinds know). A kind is a subclass of
:class:`Tokenizer`, registered by one line in :mod:`ulysses_mm.tokenize.registry`; it must
give :meth:`~Tokenizer.encode_file` and :meth:`~Tokenizer.decode`, and every other method
has a generic default:

kind-level facts, from a manifest/checkpoint tokenizer entry (``name``, ``kind``,
``params``, ``vocab_size``) without loading files or weights (classmethods):

- :meth:`~Tokenizer.token_labels`: a readable name per local id (hf tokenizer names);
- :meth:`~Tokenizer.unit`: what a token is worth (bits per base, sample, byte, second,
  frame), or None (nats per token only);

per loaded tokenizer:

- :meth:`~Tokenizer.layout`: what may follow what in a generated document, as data
  (:class:`Layout`) the generic :class:`~ulysses_mm.tokenize.grammar.Grammar` reads;
- :meth:`~Tokenizer.media`: generated ids -> the file a person opens
  (:class:`~ulysses_mm.tokenize.write.Media`: suffix, bytes, a describe() line, and why
  there is nothing to write when the ids hold no whole unit);
- :meth:`~Tokenizer.prompt_ids_for_seconds`: the first seconds of a prompt's ids;
- :meth:`~Tokenizer.fidelity` (with :attr:`~Tokenizer.fidelity_measure`,
  :meth:`~Tokenizer.fidelity_line`, :meth:`~Tokenizer.damage_alphabet`): how faithful the
  kind is on a file (``ulysses-mm tokenizer eval``);
- :meth:`~Tokenizer.picture`: the kind's panel of ``inspect --png``.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, NamedTuple

import numpy as np

from ulysses_mm.core.errors import ConfigError, DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.picture import draw_data
from ulysses_mm.tokenize.write import ArrayMedia, Media, TextMedia

Entry = dict[str, Any]  # one file's fidelity figures (JSON-able)


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


@dataclass(frozen=True)
class Interleave:
    """A second modality's span after every ``chunk_frames`` frames: ``<|modality|>``, that
    chunk's ids (``ids_per_second`` over ``seconds_per_chunk``, the chunk's edges rounded
    as the tokenizer cuts them), then back to the kind's own modality."""

    modality: str
    chunk_frames: int
    seconds_per_chunk: float
    ids_per_second: int


@dataclass(frozen=True)
class Layout:
    """What may follow what inside a kind's span (read by the generic Grammar). Default:
    any id of the range, or ``</doc>``.

    ``frame``: exactly that many ids per frame, then ``<eof>`` (forced); ``ragged``: frames
    of any length, ``<eof>`` may be sampled and is forced at ``max_frame`` ids (0: never);
    ``quantizers``: the ids cycle through that many codebooks of ``codebook_size``
    consecutive local ids (a codec's residual quantizers), ``</doc>`` only before the
    first; ``interleave``: another modality's span after every chunk of frames."""

    frame: int = 0
    ragged: bool = False
    max_frame: int = 0
    quantizers: int = 0
    codebook_size: int = 0
    interleave: Interleave | None = None


class TokenUnit(NamedTuple):
    """What a kind's token is worth: ``name`` (base, sample, byte, second, frame),
    ``weights`` the units of each local id [size], ``eof`` the units of an ``<eof>``."""

    name: str
    weights: np.ndarray
    eof: float = 0.0


class Tokenizer(ABC):
    """Raw file -> token documents, and tokens -> something a person can inspect."""

    # True: encode_stream reads a binary file object (no local copy of a remote input)
    streams: ClassVar[bool] = False

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        # records of the last input this tokenizer skipped and kept going (a bad .jsonl
        # line), and the first one's reason: ``prepare`` records them in the manifest
        self.skipped_records = 0
        self.first_skip_reason = ""

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

    # ------------------------------------------------------------ kind-level facts
    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """Readable, whitespace-free names of the ``size`` local ids of a modality whose
        manifest tokenizer entry is ``entry``; ``vocabulary``: a text tokenizer's own
        tokens when the caller has them (kinds without words ignore it). Default: the id."""
        return [str(k) for k in range(size)]

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """What a token of this kind is worth, or None (nats per token only). ``load``
        gives the loaded tokenizer, for a kind whose unit needs it (text: each id's
        bytes); it raises LookupError/OSError/ValueError when it is not here."""
        return None

    # ------------------------------------------------------------ generation
    def layout(self, space: TokenSpace) -> Layout:
        """What may follow what in a generated document of this kind, in ``space``."""
        return Layout()

    def media(
        self,
        space: TokenSpace,
        prompt: Sequence[int],
        new: Sequence[int],
        with_prompt: bool = False,
    ) -> Media:
        """``new`` ids (after ``prompt``, a document's ids from its ``<doc>``) as the file a
        person opens: the continuation alone, or everything with ``with_prompt``. Default:
        a decoded str as UTF-8 text, anything else as a ``.npy`` array."""
        data = continuation(self, space, prompt, new, with_prompt)
        if isinstance(data, str):
            return TextMedia(data)
        return ArrayMedia(np.asarray(data))

    def prompt_ids_for_seconds(
        self, space: TokenSpace, body: list[int], seconds: float
    ) -> list[int]:
        """The ids of a prompt's first ``seconds`` (``body``: its ids after
        ``<doc> <|m|>``); ConfigError for a kind without time."""
        raise ConfigError(
            f"--prompt-seconds applies to audio and video; {self.spec.name} is "
            f"{self.modality}: use --prompt-tokens"
        )

    # ------------------------------------------------------------ fidelity
    # the entry key that says how faithful the kind is ("exact", "snr_db", "psnr_db")
    fidelity_measure: ClassVar[str] = ""
    # whether fidelity() measures ids damaged at a rate (``tokenizer eval --damage``)
    damages: ClassVar[bool] = False

    def fidelity(self, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
        """How faithful this tokenizer is on one file (``tokenizer eval``); with
        ``damage`` rates, also after that fraction of ids was replaced (see
        :func:`ulysses_mm.tokenize.evaluate.damaged`). DecodeError for a bad file."""
        raise ConfigError(f"tokenizer kind {self.spec.kind!r} has no fidelity measure")

    @classmethod
    def fidelity_line(cls, entry: Entry) -> str:
        """One file's entry as the line ``tokenizer eval`` prints after the path."""
        return ", ".join(f"{k} {v}" for k, v in entry.items())

    def damage_alphabet(self) -> tuple[int, int]:
        """(vocab, codebook) of :func:`~ulysses_mm.tokenize.evaluate.flip_ids`: a damaged id
        is another of the ``vocab`` local ids, or of its own codebook of ``codebook`` ids."""
        return self.spec.vocab_size, 0

    # ------------------------------------------------------------ inspect
    def picture(self, fig: Any, cell: Any, data: Any, name: str) -> None:
        """Draw ``data`` (what :meth:`decode` gave for a sample's ids of modality ``name``)
        in the matplotlib gridspec ``cell`` of ``fig`` (``inspect --png``). Default: by its
        shape (:func:`~ulysses_mm.tokenize.picture.draw_data`): a str as an excerpt of the
        text, frames as a strip, a float array as a waveform (at ``params.sample_rate``)."""

        rate = self.spec.params.get("sample_rate", self.spec.params.get("rate"))
        draw_data(fig, cell, data, name, float(rate) if isinstance(rate, (int, float)) else None)


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


def continuation(
    tokenizer: Tokenizer,
    space: TokenSpace,
    prompt: Sequence[int],
    new: Sequence[int],
    with_prompt: bool = False,
) -> Any:
    """What ``new`` ids after ``prompt`` decode to: the whole document is decoded at once
    (a decoder may need what came before), then the prompt's share is cut off unless
    ``with_prompt``. A str loses the prompt's decoded text (or, where the whole does not
    begin with it, is the new ids decoded alone); anything else loses as many items as
    the prompt alone decodes to."""
    p = np.asarray(list(prompt), dtype=np.int64)
    allids = np.asarray(list(prompt) + list(new), dtype=np.int64)
    data = tokenizer.decode(allids, space)
    if with_prompt:
        return data
    head = tokenizer.decode(p, space)
    if isinstance(data, str):
        return (
            data[len(head) :]
            if data.startswith(head)
            else tokenizer.decode(allids[len(p) :], space)
        )
    return data[len(head) :]
