"""Text: a transformers tokenizer saved in a local directory, as one modality's id range.

The spec names the directory (``params.tokenizer``, relative to the spec file, or
absolute); it is read with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``
so a pipeline never downloads at run time, and a missing one is a one-line error naming
it. The tokenizer's ids are the modality's local ids, so a model started from the same
checkpoint (``model.init_from``) sees its own vocabulary in its text range; ``vocab_size``
in the spec is the checkpoint's vocabulary (at least the tokenizer's length).

Inputs: ``.txt`` (the whole file is one document) and ``.jsonl`` (one document per line,
the string at ``params.field``; ``params.skip_missing`` decides whether a line without
it is skipped or a DecodeError). No special tokens are added: ``<doc>``/``</doc>`` of
the token space frame the text, and decoding gives the text back exactly for a lossless
(byte-level) tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.base import DecodeError, TokenDocument, Tokenizer, TokenizerSpec
from ulysses_mm.tokenize.framing import DocumentFramer, local_ids
from ulysses_mm.tokenize.params import ParamSchema, spec_params

_SCHEMA: ParamSchema = {
    "tokenizer": ((str,), None),  # required: a directory saved with save_pretrained
    "field": ((str,), "text"),  # the string of a .jsonl line
    "skip_missing": ((bool,), False),
}


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
    from transformers import AutoTokenizer

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
        self.params: dict[str, Any] = p
        self.directory = tokenizer_dir(spec, p["tokenizer"])
        self.hf = load_hf_tokenizer(self.directory, where)
        if len(self.hf) > spec.vocab_size:
            raise DataError(
                f"{where}: the tokenizer in {self.directory} has {len(self.hf)} ids, more "
                f"than vocab_size {spec.vocab_size}"
            )

    # ------------------------------------------------------------------ encode
    def encode_text(self, text: str) -> np.ndarray:
        """Text -> local ids (int64 [n]), without the tokenizer's own special tokens."""
        ids = self.hf(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def texts(self, path: str) -> Iterator[tuple[str, str]]:
        """(key, text) of every document of a .txt or .jsonl file."""
        source = str(path)
        try:
            raw = Path(source).read_bytes()
        except OSError as e:
            raise DecodeError(f"{source}: cannot read: {e.strerror or e}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"{source}: not UTF-8 text (byte offset {e.start})") from None
        if not source.lower().endswith(".jsonl"):
            yield source, text
            return
        field = self.params["field"]
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DecodeError(f"{source}:{n}: not a JSON line: {e.msg}") from None
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                if self.params["skip_missing"]:
                    continue
                raise DecodeError(f"{source}:{n}: no string field {field!r}")
            yield f"{source}#{n}", value

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        frame = DocumentFramer(space, self.modality)  # KeyError here if the space lacks text
        n = 0
        for key, text in self.texts(path):
            ids = self.encode_text(text)
            if ids.size == 0:
                continue
            n += 1
            yield TokenDocument(str(path), key, self.modality, frame(ids))
        if n == 0:
            raise DecodeError(f"{path}: no text")

    # ------------------------------------------------------------------ decode
    def decode_local(self, ids: np.ndarray) -> str:
        ids_list = np.asarray(ids, dtype=np.int64).tolist()
        return str(self.hf.decode(ids_list, clean_up_tokenization_spaces=False))

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> str:
        """Unified ids (specials dropped) back to the text."""
        return self.decode_local(local_ids(tokens, space, self.modality))
