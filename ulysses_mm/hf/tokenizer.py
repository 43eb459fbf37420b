"""The token space as a transformers tokenizer: ``ulysses-mm hf-tokenizer MANIFEST OUT``.

Every id of the manifest's token space gets a name a person can read in a decoded
sequence: the specials as they are (``<pad>``, ``<doc>``, ``</doc>``, ``<eof>``,
``<|dna|>`` ...), then each modality's ids as ``modality:label``, the label given by the
tokenizer kind the manifest records for it, from its entry alone
(:meth:`Tokenizer.token_labels <ulysses_mm.tokenize.base.Tokenizer.token_labels>`):
the base letter (``dna:A``, ``dna:n``), the signed mu-law level (``audio:+0``), quantizer
and code (``audio:q1:17``), the codebook word (``video:vq42``), the packet bytes in hex
(``video:1a2b``), the text tokenizer's own tokens when its directory is given (whitespace
escaped) or the byte for the shipped ``text-bytes`` spec (``text:A``, ``text:<0x0A>``);
a kind with nothing better, or one not registered here, the local id (``video:17``).

The tokenizer is a word-level ``tokenizers`` model over exactly these names (vocabulary
size = the token space's), split on whitespace, with the specials as special tokens
(``<pad>`` pad, ``<doc>`` bos, ``</doc>`` eos), saved with ``save_pretrained``: so
``AutoTokenizer.from_pretrained(OUT)`` loads it, ``model.resize_token_embeddings(len(tok))``
sizes a model to our ids, ``generate`` output decodes to names, and ``decode`` then
``encode`` gives the ids back. It encodes names, not raw text or media: our tokenizer
specs turn files into ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulysses_mm.config.parse import option, positional
from ulysses_mm.core.errors import DataError, NotFoundError, first_line
from ulysses_mm.core.storage import atomic_local_dir
from ulysses_mm.core.tokenspace import SPACE_FILE, TokenSpace
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.tokenize.registry import kind_class


def modality_labels(
    entry: Mapping[str, Any], size: int, vocabulary: Sequence[str] | None = None
) -> list[str]:
    """The labels of a modality's ``size`` local ids from its manifest tokenizer entry
    (``vocabulary``: a text tokenizer's own tokens, for a kind that names ids by them)."""
    try:
        cls = kind_class(str(entry.get("kind", "")))
    except ValueError:  # a kind this process does not know: the ids
        return [str(k) for k in range(size)]
    return cls.token_labels(entry, size, vocabulary)


def token_names(
    space: TokenSpace,
    tokenizers: Mapping[str, Mapping[str, Any]],
    text_tokenizer: str | Path | None = None,
) -> list[str]:
    """One unique, whitespace-free name per id of ``space`` (index = id)."""
    text_tokens = None if text_tokenizer is None else text_tokenizer_tokens(text_tokenizer)
    names = list(space.specials)
    for r in space.ranges:
        labels = modality_labels(tokenizers.get(r.name, {}), r.size, text_tokens)
        names += [f"{r.name}:{label}" for label in labels]
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:  # two text tokens the escaping made equal: the id tells them apart
            names[i] = f"{name}#{i}"
        seen[names[i]] = i
    assert len(names) == space.vocab_size and len(set(names)) == len(names)
    return names


def text_tokenizer_tokens(path: str | Path) -> list[str]:
    """The tokens of the transformers tokenizer saved in the directory ``path``, by id; a
    directory that is missing, a file, or whose files transformers cannot read is one
    :class:`DataError` line."""
    p = Path(path)
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise NotFoundError(f"--text-tokenizer {p}: {what}; give a tokenizer directory")
    from transformers import AutoTokenizer  # lazy: heavy (transformers)

    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        return [str(t) for t in tok.convert_ids_to_tokens(list(range(len(tok))))]
    # what transformers raises on unreadable files has no common base beyond these
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        raise DataError(
            f"--text-tokenizer {p}: not a transformers tokenizer directory ({first_line(e)})"
        ) from None


def build_tokenizer(
    space: TokenSpace,
    tokenizers: Mapping[str, Mapping[str, Any]],
    text_tokenizer: str | Path | None = None,
    model_max_length: int | None = None,
):
    """A ``PreTrainedTokenizerFast`` whose vocabulary is ``space`` (see the module
    docstring)."""
    from transformers import PreTrainedTokenizerFast  # lazy: heavy (transformers)

    from tokenizers import (  # lazy: only building a tokenizer needs it
        AddedToken,
        Tokenizer,
        models,
        pre_tokenizers,
    )

    names = token_names(space, tokenizers, text_tokenizer)
    core = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in space.specials])
    kwargs: dict[str, Any] = {}
    if model_max_length:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=space.specials[0],
        bos_token=space.specials[1],
        eos_token=space.specials[2],
        additional_special_tokens=list(space.specials[3:]),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def write_tokenizer(
    manifest: Manifest, out: str | Path, text_tokenizer: str | Path | None = None
) -> Path:
    """Save the tokenizer of ``manifest``'s token space in ``out`` (with the token space
    as ``token_space.json``); written beside ``out`` and renamed into place, so ``out``
    is complete or absent. An existing non-empty ``out`` is refused."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty directory; give a new one")
    tok = build_tokenizer(
        manifest.token_space, manifest.tokenizers, text_tokenizer, manifest.seq_len
    )
    with atomic_local_dir(out) as tmp:
        tok.save_pretrained(str(tmp))
        (tmp / SPACE_FILE).write_text(json.dumps(manifest.token_space.to_dict(), indent=1) + "\n")
    return out


@dataclass
class HfTokenizer:
    """``ulysses-mm hf-tokenizer``: a transformers tokenizer whose vocabulary is a
    manifest's token space, with readable names (AutoTokenizer.from_pretrained)."""

    manifest: str = positional("manifest.json (path or URL) or its dataset directory", "in_path")
    out: str = positional(
        "new output directory (tokenizer.json + tokenizer_config.json)", "out_dir"
    )
    text_tokenizer: str | None = option(
        "the text modality's transformers tokenizer directory, to name text ids by its "
        "tokens (default: bytes for the shipped text-bytes spec, else the local id)", None,
        path="in_dir", exist=True,
    )  # fmt: skip

    def main(self) -> int:
        manifest = Manifest.load(self.manifest)
        out = write_tokenizer(manifest, self.out, self.text_tokenizer)
        print(
            f"wrote a transformers tokenizer of the {manifest.token_space.describe()} to {out} "
            "(AutoTokenizer.from_pretrained)"
        )
        return 0
