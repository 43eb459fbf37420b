"""DNA: one token per base, from FASTA, FASTQ (wrapped records too) and GenBank, plain or gzip.

Records are read with Biopython (``SimpleFastaParser``, ``FastqGeneralIterator``,
``SeqIO.parse(…, "genbank")``); each record becomes one :class:`TokenDocument` keyed
``f"{source}#{record id}"`` (the id is the header's first word; a repeated id gets ``~1``,
``~2``…, an empty one ``record{index}``). The format is sniffed from the content (``>``,
``@``, ``LOCUS``) and gzip from its magic bytes, never from the file name; the optional
param ``format`` makes the sniffed format mandatory. Bases become ids through a 256-entry byte table applied
with ``bytes.translate`` (C speed, no per-base Python), so throughput is bounded by
gzip and the parser, not by tokenisation.

Policies (spec ``params``), chosen explicitly so nothing is silently dropped:

``case``     ``"keep"``: lowercase (soft-masked) bases are their own tokens a c g t n…;
             ``"fold"``: lowercase is read as uppercase.
``iupac``    ``"keep"``: the ambiguity codes R Y S W K M B D H V are their own tokens;
             ``"to_n"``: each becomes N (n when lowercase and case is kept): an ambiguous
             base is an unknown base.
``invalid``  any other character (U, gaps ``-``/``.``, ``*``, digits, bytes > 127):
             ``"error"``: DecodeError naming the record, the offset and the character;
             ``"to_n"``: it becomes N.

Vocabulary (local ids; ``vocab_size`` in the spec must equal its length)::

    A C G T N [R Y S W K M B D H V]  [a c g t n [r y s w k m b d h v]]
    0 1 2 3 4  5 ...               (iupac keep)   (case keep: the same letters, lowercase)

so A C G T N are ids 0-4 under every policy. Decoding gives back exactly the input
sequence under the policy: ``decode(encode(s)) == policy(s)``. GenBank ORIGIN blocks are
case-insensitive by convention and Biopython reads them uppercase.

``annotations`` (null, or ``{"spec": "<text spec>.json", "place": "document"|"prefix"}``):
each record's header (FASTA/FASTQ: the whole title line; GenBank: id, description and
the feature table, one feature a line) is also tokenized with that text tokenizer, as
a text document just before the sequence's (``document``), or as a ``<|text|>`` span at
the start of the sequence's own document, so the bases can attend to it (``prefix``).
The text modality must then be in the token space too (a companion spec).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tokenize.base import (
    DecodeError,
    Entry,
    TokenBlock,
    TokenDocument,
    Tokenizer,
    TokenizerSpec,
    TokenUnit,
    continuation,
)
from ulysses_mm.tokenize.dna.fidelity import dna_line, eval_dna
from ulysses_mm.tokenize.dna.output import FastaMedia, draw_gc
from ulysses_mm.tokenize.dna.records import iter_annotated_records
from ulysses_mm.tokenize.dna.stream import stream_blocks
from ulysses_mm.tokenize.framing import DocumentFramer, local_ids
from ulysses_mm.tokenize.params import ParamSchema, check_choice, spec_params
from ulysses_mm.tokenize.registry import load_tokenizer
from ulysses_mm.tokenize.text.tokenizer import TextTokenizer
from ulysses_mm.tokenize.write import Media

BASES = "ACGTN"
AMBIGUITY = "RYSWKMBDHV"  # IUPAC nucleotide ambiguity codes besides N
_INVALID = 255  # byte-table sentinel for a character the policy rejects

_SCHEMA: ParamSchema = {
    "case": ((str,), "keep"),
    "iupac": ((str,), "to_n"),
    "invalid": ((str,), "error"),
    "format": ((str, type(None)), None),  # null: any; else the sniffed format must be it
    "annotations": ((dict, type(None)), None),  # null, or {"spec": ..., "place": ...}
}


def alphabet(case: str, iupac: str) -> str:
    """The letters of the local ids, in id order, for a policy."""
    upper = BASES + (AMBIGUITY if iupac == "keep" else "")
    return upper + (upper.lower() if case == "keep" else "")


def translation_table(case: str, iupac: str, invalid: str) -> bytes:
    """byte -> local id (``_INVALID`` where the policy rejects the byte), for bytes.translate."""
    letters = alphabet(case, iupac)
    table = bytearray([_INVALID] * 256)
    if invalid == "to_n":
        table = bytearray([letters.index("N")] * 256)
    for ch in BASES + AMBIGUITY:
        for c in (ch, ch.lower()):
            target = c if case == "keep" else c.upper()
            if target.upper() in AMBIGUITY and iupac == "to_n":
                target = "n" if target.islower() else "N"
            table[ord(c)] = letters.index(target)
    return bytes(table)


class DnaTokenizer(Tokenizer):
    """kind ``dna-base``: one token per base under the spec's case/IUPAC/invalid policy."""

    streams = True
    fidelity_measure = "exact"

    def __init__(self, spec: TokenizerSpec) -> None:
        super().__init__(spec)
        p = spec_params(spec, _SCHEMA)
        check_choice(spec, "case", p["case"], ("keep", "fold"))
        check_choice(spec, "iupac", p["iupac"], ("keep", "to_n"))
        check_choice(spec, "invalid", p["invalid"], ("error", "to_n"))
        if p["format"] is not None:
            check_choice(spec, "format", p["format"], ("fasta", "fastq", "genbank"))
        self.params: dict[str, Any] = p
        self.letters = alphabet(p["case"], p["iupac"])
        if spec.vocab_size != len(self.letters):
            raise DataError(
                f"{spec.where}: vocab_size {spec.vocab_size} does not match the "
                f"policy case={p['case']} iupac={p['iupac']}, which uses {len(self.letters)} "
                f"ids ({self.letters})"
            )
        self.table = translation_table(p["case"], p["iupac"], p["invalid"])
        self._letters_u8 = np.frombuffer(self.letters.encode("ascii"), dtype=np.uint8)
        self.text: Any = None  # the annotations' TextTokenizer
        self.place = "document"
        if p["annotations"] is not None:
            self.text, self.place = self._load_text(p["annotations"])

    def _load_text(self, cfg: dict[str, Any]) -> tuple[Any, str]:
        where = self.spec.where
        place = cfg.get("place", "document")
        if not set(cfg) <= {"spec", "place"} or not isinstance(cfg.get("spec"), str):
            raise DataError(
                f"{where}: param 'annotations' must be "
                '{"spec": "<text spec>.json", "place": "document" or "prefix"}'
            )
        check_choice(self.spec, "annotations.place", place, ("document", "prefix"))
        path = Path(self.spec.path).parent / cfg["spec"] if self.spec.path else Path(cfg["spec"])
        if not path.is_file():
            raise DataError(f"{where}: text spec {cfg['spec']} not found (looked at {path})")
        text = load_tokenizer(path)
        if not isinstance(text, TextTokenizer):
            raise DataError(f"{where}: {cfg['spec']} is not a text tokenizer spec")
        return text, place

    def companion_specs(self) -> list[TokenizerSpec]:
        """The text spec of the annotations: its modality must be in the token space."""
        return [] if self.text is None else [self.text.spec]

    # ------------------------------------------------------------------ encode
    def encode_sequence(self, seq: str | bytes, where: str = "sequence") -> np.ndarray:
        """Bases -> local ids (uint8 [n]); DecodeError for a character the policy rejects."""
        raw = seq.encode("latin-1") if isinstance(seq, str) else seq
        ids = raw.translate(self.table)
        bad = ids.find(_INVALID)
        if bad >= 0:
            ch = chr(raw[bad])
            raise DecodeError(
                f"{where}: character {ch!r} (byte 0x{raw[bad]:02x}) at base offset {bad} is not "
                f"a nucleotide or IUPAC code (policy invalid=error)"
            )
        return np.frombuffer(ids, dtype=np.uint8)

    def encode_file(self, path: str, space: TokenSpace) -> Iterator[TokenDocument]:
        source = str(path)
        DocumentFramer(space, self.modality)  # KeyError here if the space lacks dna
        if not Path(source).is_file():
            raise DecodeError(f"{source}: no such file")
        records = iter_annotated_records(source, self.params["format"])
        n = 0
        for done, doc in self.documents(source, records, space):
            n = done
            yield doc
        if n == 0:
            raise DecodeError(f"{source}: no sequence records")

    def documents(
        self,
        source: str,
        records: Iterator[tuple[str, str, str]],
        space: TokenSpace,
        first: int = 0,
    ) -> Iterator[tuple[int, TokenDocument]]:
        """(records so far, document) for each record of ``records`` (id, sequence,
        header), numbered from ``first``: its sequence's document, after or around its
        header's when the spec annotates."""
        frame = DocumentFramer(space, self.modality)
        text_frame = None if self.text is None else DocumentFramer(space, self.text.modality)
        seen: dict[str, int] = {}
        n = first
        for rec_id, seq, header in records:
            rid = rec_id or f"record{n}"
            k = seen.get(rid, 0)
            seen[rid] = k + 1
            key = f"{source}#{rid}" if k == 0 else f"{source}#{rid}~{k}"
            ids = self.encode_sequence(seq, where=f"{source}#{rid}")
            n += 1
            tokens = frame(ids)
            if text_frame is not None and header.strip():
                words = text_frame(self.text.encode_text(header))  # <doc> <|text|> … </doc>
                if self.place == "document":
                    yield n, TokenDocument(source, key + "#header", self.text.modality, words)
                else:  # <doc> <|text|> … <|dna|> bases </doc>
                    tokens = np.concatenate([words[:-1], tokens[1:]])
            yield n, TokenDocument(source, key, self.modality, tokens)

    def encode_stream(self, f: IO[bytes], source: str, space: TokenSpace) -> Iterator[TokenBlock]:
        """The documents of ``f`` (plain or gzip) as blocks, the tokens :meth:`encode_file`
        gives, read in bounded blocks (:mod:`ulysses_mm.tokenize.dna.stream`)."""
        return stream_blocks(self, f, source, space)

    # ------------------------------------------------------------------ decode
    def decode_local(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.letters)):
            raise ValueError(f"DNA local id out of range 0..{len(self.letters) - 1}")
        return self._letters_u8[ids].tobytes().decode("ascii")

    def decode(self, tokens: np.ndarray, space: TokenSpace) -> str:
        """Unified ids (specials dropped) back to the sequence, as a str."""
        return self.decode_local(local_ids(tokens, space, self.modality))

    def normalise(self, seq: str) -> str:
        """What ``decode(encode(seq))`` gives under this policy (DecodeError if rejected)."""
        return self.decode_local(self.encode_sequence(seq))

    # ------------------------------------------------------------------ contract
    @classmethod
    def token_labels(
        cls, entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
    ) -> list[str]:
        """The base letter of each id (``A``, ``n``)."""
        params = entry.get("params") or {}
        letters = alphabet(params.get("case", "keep"), params.get("iupac", "to_n"))
        if len(letters) == size:
            return list(letters)
        return super().token_labels(entry, size, vocabulary)

    @classmethod
    def unit(
        cls, entry: Mapping[str, Any], size: int, load: Callable[[], Tokenizer]
    ) -> TokenUnit | None:
        """Bits per base: every id is one."""
        return TokenUnit("base", np.ones(size))

    def media(
        self,
        space: TokenSpace,
        prompt: Sequence[int],
        new: Sequence[int],
        with_prompt: bool = False,
    ) -> Media:
        """The bases as a FASTA record."""
        return FastaMedia(continuation(self, space, prompt, new, with_prompt))

    def fidelity(self, path: str, damage: Sequence[float] = (), seeds: int = 5) -> Entry:
        """Whether every record's bases come back exactly (see
        :func:`~ulysses_mm.tokenize.dna.fidelity.eval_dna`)."""
        return eval_dna(self, path)

    @classmethod
    def fidelity_line(cls, entry: Entry) -> str:
        return dna_line(entry)

    def picture(self, fig: Any, cell: Any, data: Any, name: str) -> None:
        """The GC fraction along the sample's bases."""
        draw_gc(fig, cell, data, name)
