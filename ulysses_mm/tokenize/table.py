"""Which tokenizer wrote each modality of a dataset, and how to load it again.

A manifest records, per modality, its tokenizer spec's entry (name, kind, params, the
spec's and artifact's sha256) and the spec files the pipeline named; a checkpoint keeps
the same record (``tokenizers.json``), so a trained model's prompts go through the very
tokenizers of its training data and its ids decode through them.

A spec is found by its sha256: among the files recorded, then any ``tokenizers/*.json``
of the working directory or of this repository; a spec without a learned artifact can
also be rebuilt from the entry alone, which holds every parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ulysses_mm.core import storage
from ulysses_mm.core.resources import resource
from ulysses_mm.tokenize import registry
from ulysses_mm.tokenize.base import Tokenizer, TokenizerSpec


@dataclass
class TokenizerTable:
    """Per modality, the spec entry a manifest recorded; the spec files and the extra
    kinds (``tokenizer_kinds``) of the pipelines that wrote the data. A tokenizer, once
    loaded, is kept (a training run asks again at every eval)."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    spec_paths: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    loaded: dict[str, Tokenizer] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_manifest(
        cls, tokenizers: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any]
    ) -> TokenizerTable:
        """From a manifest's ``tokenizers`` and ``config`` fields."""
        return cls.from_dict(
            {
                "tokenizers": tokenizers,
                "spec_paths": config.get("tokenizers"),
                "kinds": config.get("tokenizer_kinds"),
            }
        )

    @classmethod
    def merged(cls, tables: Iterable[TokenizerTable]) -> TokenizerTable:
        """Several datasets' tables as one (the first to name a modality wins)."""
        out = cls()
        for t in tables:
            for m, e in t.entries.items():
                out.entries.setdefault(m, e)
            out.spec_paths += [p for p in t.spec_paths if p not in out.spec_paths]
            for k, v in t.kinds.items():
                out.kinds.setdefault(k, v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"tokenizers": self.entries, "spec_paths": self.spec_paths, "kinds": self.kinds}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenizerTable:
        return cls(
            {str(m): dict(e) for m, e in (data.get("tokenizers") or {}).items()},
            [str(p) for p in data.get("spec_paths") or []],
            {str(k): str(v) for k, v in (data.get("kinds") or {}).items()},
        )

    def tokenizer(self, modality: str) -> Tokenizer:
        """The tokenizer of ``modality``; LookupError says why it cannot be had."""
        if modality not in self.loaded:
            self.loaded[modality] = self._load(modality)
        return self.loaded[modality]

    def kind_class(self, modality: str) -> type[Tokenizer] | None:
        """The Tokenizer class of ``modality``'s recorded kind (its facts without loading
        it), or None where no entry is recorded or its kind is not known here."""
        entry = self.entries.get(modality)
        if entry is None:
            return None
        self._register_kinds()
        try:
            return registry.kind_class(str(entry.get("kind", "")))
        except (ValueError, ImportError, AttributeError):
            return None

    def _register_kinds(self) -> None:
        for kind, target in self.kinds.items():
            registry.register_kind(kind, target)

    def _load(self, modality: str) -> Tokenizer:
        entry = self.entries.get(modality)
        if entry is None:
            raise LookupError(f"no tokenizer is recorded for {modality!r}")
        self._register_kinds()
        want = entry.get("spec_sha256")
        candidates = [Path(p) for p in self.spec_paths if not storage.is_url(p)]
        for d in dict.fromkeys([Path.cwd() / "tokenizers", resource("tokenizers")]):
            if d.is_dir():
                candidates += sorted(d.glob("*.json"))
        for path in candidates:
            if not path.is_file():
                continue
            try:
                spec = TokenizerSpec.load(path)
            except (OSError, ValueError):
                continue
            if spec.sha256 == want:
                return registry.load_tokenizer(spec)
        if entry.get("artifact_sha256") is None:
            spec = TokenizerSpec(
                name=str(entry.get("name")),
                modality=modality,
                kind=str(entry.get("kind")),
                vocab_size=int(entry.get("vocab_size", 0)),
                params=dict(entry.get("params") or {}),
            )
            return registry.load_tokenizer(spec)
        raise LookupError(
            f"no spec file with sha256 {str(want)[:12]}… for {entry.get('name')!r} "
            f"(it has a learned artifact; looked at the recorded paths and tokenizers/)"
        )
