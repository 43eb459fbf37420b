"""How faithful a DNA spec is: whether every record's bases come back exactly."""

from __future__ import annotations

from typing import Any

import numpy as np

from ulysses_mm.tokenize.base import DecodeError, Entry
from ulysses_mm.tokenize.dna.records import iter_records


def eval_dna(tok: Any, path: str) -> Entry:
    """Every record's bases tokenized and decoded: ``exact`` is whether all of them come
    back character for character (``mismatches`` counts the bases that do not, e.g. IUPAC
    codes folded to N by the policy)."""
    records = bases = mismatches = 0
    for _rid, seq in iter_records(path, tok.params["format"]):
        back = tok.decode_local(tok.encode_sequence(seq, where=path))
        records += 1
        bases += len(seq)
        if back != seq:
            a = np.frombuffer(seq.encode("latin-1"), dtype=np.uint8)
            b = np.frombuffer(back.encode("latin-1"), dtype=np.uint8)
            mismatches += int(np.count_nonzero(a != b))
    if records == 0:
        raise DecodeError(f"{path}: no sequence records")
    return {"exact": mismatches == 0, "records": records, "bases": bases, "mismatches": mismatches}


def dna_line(entry: Entry) -> str:
    verdict = "exact" if entry["exact"] else f"NOT exact ({entry['mismatches']} bases differ)"
    return f"{verdict}; {entry['records']} records, {entry['bases']} bases"
