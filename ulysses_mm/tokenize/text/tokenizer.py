"""Text: a transformers tokenizer saved in a local directory, as one modality's id range.

The spec names the directory (``params.tokenizer``, relative to the spec file, or
absolute); it is read with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``
so a pipeline never downloads at run time, and a missing one is a one-line error naming
it. The tokenizer's ids are the modality's local ids, so a model started from the same
checkpoint (``model.init_from``) sees its own vocabulary in its text range; ``vocab_size``
in the spec is the checkpoint's vocabulary (at least the tokenizer's length).

Inputs: ``.txt`` (the whole file is one document) and ``.jsonl`` (one document per line,
the string at ``params.field``). No special tokens are added: ``<doc>``/``</doc>`` of the
token space frame the text, and decoding gives the text back exactly for a lossless
(byte-level) tokenizer.

Memory stays bounded whatever the input's size: a record (a ``.txt`` file, a ``.jsonl``
line) is at most ``params.max_record_bytes``, checked before it is read whole (a ``.txt``
by its size, a line by reading at most that many bytes of it), and a long record is
tokenized in pieces, since a transformers tokenizer holds a few hundred bytes per input
byte while it encodes. Pieces end at a single space or newline between two non-space
characters, where a byte-level pre-tokenizer splits anyway, so for those the ids equal
one call's. A ``.txt`` over the cap is a DecodeError naming its size; a ``.jsonl`` line
over it, not UTF-8, not JSON, or without the string field is skipped on its own and
counted in :attr:`TextTokenizer.skipped_records` with the first reason, which ``prepare``
records in the manifest's entry for the input: one bad line never costs the file's good
ones. A file of which no line gives a document (a misspelt ``params.field``, say) is a
DecodeError with the first line's reason. ``params.skip_missing: false`` makes a line
without the field fail its file instead, for corpora where that means a broken export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.base import (
    DecodeError,
    TokenDocument,
    Tokenizer,
    TokenizerSpec,
    TokenUnit,
)
from ulysses_mm.tokenize.framing import DocumentFramer, local_ids
from ulysses_mm.tokenize.params import ParamSchema, spec_params

_SCHEMA: ParamSchema = {
    "tokenizer": ((str,), None),  # required: a directory saved with save_pretrained
    "field": ((str,), "text"),  # the string of a .jsonl line
    "skip_missing": ((bool,), True),  # a .jsonl line without the field: skip (else fail)
    "max_record_bytes": ((int,), 64 << 20),  # a .txt file or a .jsonl line, at most
}
_PIECE_CHARS = 1 << 16  # characters a single tokenizer call encodes, at most
_SKIP_CHUNK = 1 << 20  # bytes read at a time while skipping the rest of an over-cap line


def tokenizer_dir(spec: TokenizerSpec, value: str) -> Path:
    """The spec's tokenizer directory: relative to the spec file, or absolute."""
    p = Path(value).expanduser()
    return p if p.is_absolute() or not spec.path else Path(spec.path).parent / p


def load_hf_tokenizer(path: Path, where: str) -> Any:
    """``AutoTokenizer`` from a local directory only; DataError naming it otherwise."""
    if not path.is_dir():
        raise DataError(
            f"{where}: tokenizer directory {path} not found (a transformers tokenizer saved "
            "with save_pretrained; nothing is downloaded)"
        )
    from transformers import AutoTokenizer  # lazy: heavy (transformers)

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{where}: cannot load the tokenizer in {path}: {first}") from None


class TextTokenizer(Tokenizer):
    """kind ``text``: a local transformers tokenizer; .txt and .jsonl inputs."""

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, _SCHEMA)
        where = spec.where
        if p["tokenizer"] is None:
            raise DataError(f"{where}: param 'tokenizer' (a tokenizer directory) is required")
        if p["max_record_bytes"] < 1:
            raise DataError(f"{where}: param 'max_record_bytes' must be >= 1")
        self.params: dict[str, Any] = p
        self.skipped_records = 0  # .jsonl lines the last texts() call skipped
        self.first_skip_reason = ""
        self.directory = tokenizer_dir(spec, p["tokenizer"])
        self.hf = load_hf_tokenizer(self.directory, where)
        if len(self.hf) > spec.vocab_size:
            raise DataError(
                f"{where}: the tokenizer in {self.directory} has {len(self.hf)} ids, more "
                f"than vocab_size {spec.vocab_size}"
            )

    # ------------------------------------------------------------------ encode
    def encode_text(self, text: str) -> np.ndarray:
        """Text -> local ids (int64 [n]), without the tokenizer's own special tokens; a
        long text in pieces of at most ``_PIECE_CHARS`` characters."""
        parts = [
            np.asarray(self.hf(piece, add_special_tokens=False)["input_ids"], dtype=np.int64)
            for piece in text_pieces(text, _PIECE_CHARS)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _skip(self, reason: str) -> None:
        if not self.skipped_records:
            self.first_skip_reason = reason
        self.skipped_records += 1

    def texts(self, path: str) -> Iterator[tuple[str, str]]:
        """(key, text) of every document of a .txt or .jsonl file, read a record at a time;
        the records skipped are counted in ``skipped_records`` (reset here)."""
        source = str(path)
        cap = self.params["max_record_bytes"]
        self.skipped_records, self.first_skip_reason = 0, ""
        try:
            with open(source, "rb") as f:
                if not source.lower().endswith(".jsonl"):
                    size = os.fstat(f.fileno()).st_size
                    if size > cap:
                        raise DecodeError(
                            f"{source}: {size} bytes, over max_record_bytes {cap} (a .txt "
                            "file is one document)"
                        )
                    raw = f.read(cap + 1)  # the file may have grown since
                    if len(raw) > cap:
                        raise DecodeError(f"{source}: over max_record_bytes {cap}")
                    yield source, _utf8(raw, source)
                    return
                yield from self._jsonl(f, source, cap)
        except OSError as e:
            raise DecodeError(f"{source}: cannot read: {e.strerror or e}") from None

    def _jsonl(self, f: BinaryIO, source: str, cap: int) -> Iterator[tuple[str, str]]:
        field = self.params["field"]
        n = 0
        while line := f.readline(cap + 2):  # the line, its newline and one byte more
            n += 1
            body = line.rstrip(b"\r\n") if line.endswith(b"\n") else line
            if len(body) > cap:
                size = len(line)
                while line and not line.endswith(b"\n"):  # the rest of it, a chunk at a time
                    line = f.readline(_SKIP_CHUNK)
                    size += len(line)
                self._skip(f"{source}:{n}: a line over max_record_bytes {cap} ({size} bytes)")
                continue
            if not body.strip():
                continue
            try:
                record = json.loads(body.decode("utf-8"))
            except UnicodeDecodeError as e:
                self._skip(f"{source}:{n}: not UTF-8 text (byte offset {e.start})")
                continue
            except json.JSONDecodeError as e:
                self._skip(f"{source}:{n}: not a JSON line: {e.msg}")
                continue
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                if not self.params["skip_missing"]:
                    raise DecodeError(f"{source}:{n}: no string field {field!r}")
                self._skip(f"{source}:{n}: no string field {field!r}")
                continue
            yield f"{source}#{n}", value

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        frame = DocumentFramer(space, self.modality)  # KeyError here if the space lacks text
        n = 0
        for key, text in self.texts(path):
            ids = self.encode_text(text)
            del text
            if ids.size == 0:
                continue
            n += 1
            yield TokenDocument(str(path), key, self.modality, frame(ids))
        if n == 0:
            raise DecodeError(self.first_skip_reason or f"{path}: no text")

    # ------------------------------------------------------------------ decode
    def decode_local(self, ids: np.ndarray) -> str:
        ids_list = np.asarray(ids, dtype=np.int64).tolist()
        return str(self.hf.decode(ids_list, clean_up_tokenization_spaces=False))

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> str:
        """Unified ids (specials dropped) back to the text."""
        return self.decode_local(local_ids(tokens, space, self.modality))

    # ------------------------------------------------------------------ contract
    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The tokenizer's own tokens when the caller has them (whitespace escaped), the
        byte for the shipped ``text-bytes`` spec (``A``, ``<0x0A>``), else the id."""
        if vocabulary is not None:
            return [_escape(t) for t in vocabulary[:size]] + [
                str(k) for k in range(len(vocabulary), size)
            ]
        if entry.get("name") == "text-bytes" and size == 256:
            return [_byte(b) for b in range(256)]
        return super().token_labels(entry, size, vocabulary)

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per UTF-8 byte: each id counts the bytes it decodes to; None when the
        tokenizer is not here."""
        try:
            return TokenUnit("byte", token_bytes(load(), size))
        except (LookupError, OSError, ValueError):
            return None


def _escape(token: str) -> str:
    """A token without whitespace (hf names are split on it), still readable."""
    return "".join(f"<0x{ord(c):02X}>" if c.isspace() or not c.isprintable() else c for c in token)


def _byte(b: int) -> str:
    return chr(b) if 33 <= b <= 126 else f"<0x{b:02X}>"


def token_bytes(tokenizer: Any, size: int) -> np.ndarray:
    """UTF-8 bytes each local id of a transformers tokenizer decodes to (a byte-level
    token's characters are bytes, ``<0xNN>`` is one byte, an added special is none)."""
    hf = tokenizer.hf
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # lazy: heavy (transformers)

    byte_chars = set(bytes_to_unicode().values())
    special = set(getattr(hf, "all_special_ids", []) or [])
    out = np.zeros(size, dtype=np.float64)
    n = min(size, len(hf))
    for i, t in enumerate(hf.convert_ids_to_tokens(list(range(n)))):
        if i in special or t is None:
            continue
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            out[i] = 1
        elif all(c in byte_chars for c in t):
            out[i] = len(t)
        else:
            out[i] = len(hf.decode([i]).encode("utf-8"))
    return out


def _utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"{source}: not UTF-8 text (byte offset {e.start})") from None


def text_pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at most about ``size`` characters (the whole text when it is
    shorter), each but the last ending just before a single space or newline that has a
    non-space character on each side; a piece with no such place ends at ``size``."""
    start, n = 0, len(text)
    while n - start > size:
        end = start + size
        cut = -1
        for sep in ("\n", " "):
            at = text.rfind(sep, start + size // 2, end)
            while at > start and not _between_words(text, at):
                at = text.rfind(sep, start + size // 2, at)
            if at > start:
                cut = at + 1 if sep == "\n" else at  # "\n" ends a piece, " " opens one
                break
        end = cut if cut > start else end
        yield text[start:end]
        start = end
    yield text[start:]


def _between_words(text: str, at: int) -> bool:
    return 0 < at < len(text) - 1 and not text[at - 1].isspace() and not text[at + 1].isspace()
