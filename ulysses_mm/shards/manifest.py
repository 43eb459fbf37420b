"""``manifest.json``: what a dataset holds and how to trust it.

Written last and atomically by ``prepare``, so a dataset directory either has a manifest
that describes every shard beside it exactly, or no manifest at all. Training reads the
manifest first (token space, seq_len, shard list) and every shard through
:func:`read_verified_shard`, which checks its size and sha256.

Layout (JSON object, ``format_version`` 1)::

    format, format_version   "ulysses-mm-shards", 1
    name                     dataset name from the pipeline
    token_space              TokenSpace.to_dict()
    tokenizers               {modality: TokenizerSpec.manifest_entry()} (spec/artifact sha256)
    seq_len, dtype           tokens per sample, numpy dtype name of tokens.npy
    num_samples, num_documents
    tokens                   {modality: real (non-pad) tokens}, counted by the primary
                             modality of the document they belong to, specials included;
                             sum(tokens) + pad_tokens == num_samples * seq_len
    pad_tokens
    shards                   [{url (relative to the manifest), samples, first_sample, bytes, sha256
                               [, partition]}]
    modality_runs            [[modality, tokens], ...]: the packed token stream (every sample's
                             segments in order) as runs of one modality, so the tokens of each
                             modality in every sample follow without reading a shard
                             (optional: manifests written before it lack it)
    inputs                   [{source, status "ok", modality, documents, tokens, first_doc_id
                               [, skipped_records, skip_reason: records of the input left
                               out, e.g. bad .jsonl lines, and the first one's reason]}
                              | {source, status "skipped", reason}], in packing order
    config                   the resolved pipeline config, less where and how it ran
                             (output, staging, workers, engine, storage options, progress)
    partitions               only for a dataset of several partitions (shards in
                             ``part-PPPPP/``): [{first_input, inputs, input_bytes,
                             first_sample, samples, first_doc_id, documents, runs}], each
                             packed on its own. Inside a partition's shards the sample keys
                             and document ids count from 0: sample ``first_sample + k`` has
                             key ``k``, document id ``d`` is ``first_doc_id + d``; its
                             ``runs`` entries of ``modality_runs`` are its token stream.
                             The inputs' ``first_doc_id`` are dataset-wide.
    sample_pairs             [pairs] per sample: Σ l·(l+1)/2 over its documents, the causal
                             attention it costs (balanced steps weigh samples by it;
                             optional: manifests written before it lack it)

Nothing in it depends on time, host or output location, so equal data give equal bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from ulysses_mm.core import storage
from ulysses_mm.core.errors import DataError, RangeError, first_line
from ulysses_mm.core.tokenspace import TokenSpace

FORMAT = "ulysses-mm-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
READ_TIMEOUTS = (10.0, 60.0)  # connect, read seconds: data.connect_timeout_s, read_timeout_s
MAX_MANIFEST_BYTES = 256 << 20  # a bigger body is refused unread: data.max_manifest_bytes
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(DataError):
    """A manifest cannot be read or is inconsistent; the message names the file."""


class ShardIntegrityError(DataError):
    """A shard's bytes do not match its manifest entry (size or sha256)."""


@dataclass(kw_only=True)
class ShardEntry:
    url: str  # relative to the manifest's directory (or an absolute URL/path)
    samples: int
    first_sample: int
    bytes: int
    sha256: str
    partition: int | None = None  # in a dataset of several partitions

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "samples": self.samples,
            "first_sample": self.first_sample,
            "bytes": self.bytes,
            "sha256": self.sha256,
            **({"partition": self.partition} if self.partition is not None else {}),
        }


@dataclass(kw_only=True)
class PartitionEntry:
    """One partition of the inputs, packed on its own (see the module docstring)."""

    first_input: int
    inputs: int
    input_bytes: int
    first_sample: int
    samples: int
    first_doc_id: int
    documents: int
    runs: int  # its entries of modality_runs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartitionEntry:
        """The entry :meth:`to_dict` wrote (KeyError, TypeError: not one)."""
        return cls(**{f.name: _int(d[f.name]) for f in fields(cls)})


@dataclass
class InputEntry:
    source: str
    status: str  # "ok" | "skipped"
    modality: str = ""
    documents: int = 0
    tokens: int = 0
    first_doc_id: int = 0
    reason: str = ""
    skipped_records: int = 0  # records of an ok input left out (bad .jsonl lines)
    skip_reason: str = ""  # the first of them

    def to_dict(self) -> dict[str, Any]:
        if self.status == "ok":
            note = (
                {"skipped_records": self.skipped_records, "skip_reason": self.skip_reason}
                if self.skipped_records
                else {}
            )
            return {
                "source": self.source,
                "status": "ok",
                "modality": self.modality,
                "documents": self.documents,
                "tokens": self.tokens,
                "first_doc_id": self.first_doc_id,
                **note,
            }
        return {"source": self.source, "status": self.status, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InputEntry:
        """The entry :meth:`to_dict` wrote (KeyError, TypeError: not one)."""
        return cls(
            source=str(d["source"]),
            status=str(d["status"]),
            modality=str(d.get("modality", "")),
            documents=_int(d.get("documents", 0)),
            tokens=_int(d.get("tokens", 0)),
            first_doc_id=_int(d.get("first_doc_id", 0)),
            reason=str(d.get("reason", "")),
            skipped_records=_int(d.get("skipped_records", 0)),
            skip_reason=str(d.get("skip_reason", "")),
        )


@dataclass
class Manifest:
    name: str
    token_space: TokenSpace
    tokenizers: dict[str, dict[str, Any]]
    seq_len: int
    shards: list[ShardEntry]
    inputs: list[InputEntry]
    num_documents: int
    tokens: dict[str, int]
    pad_tokens: int
    config: dict[str, Any] = field(default_factory=dict)
    # the token stream as [(modality, tokens)] runs; None = not recorded (an older prepare)
    modality_runs: list[tuple[str, int]] | None = None
    # several partitions, each packed on its own; None: one
    partitions: list[PartitionEntry] | None = None
    # each sample's causal pairs inside its documents (core.format.sample_pairs), what
    # balanced steps weigh samples by; None = not recorded (an older prepare)
    sample_pairs: list[int] | None = None
    format_version: int = FORMAT_VERSION
    # where it was loaded from / saved to, with its storage options and the timeouts it
    # was read with (not serialised)
    where: storage.Location = field(default=storage.Location(""), compare=False, repr=False)

    # ---------------------------------------------------------------- queries
    @property
    def location(self) -> str:
        """The path or URL of this manifest.json ('' when neither loaded nor saved)."""
        return self.where.url

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def dtype(self) -> str:
        return self.token_space.dtype().name

    @property
    def skipped(self) -> list[InputEntry]:
        return [i for i in self.inputs if i.status != "ok"]

    def shard_location(self, shard: int | ShardEntry) -> str:
        """Path or URL of a shard, resolved against the manifest's directory."""
        entry = self.shards[shard] if isinstance(shard, int) else shard
        if storage.is_url(entry.url) or entry.url.startswith("/"):
            return entry.url
        base = self.location.rsplit("/", 1)[0] if "/" in self.location else "."
        return storage.join(base, entry.url)

    def shard_where(self, shard: int | ShardEntry) -> storage.Location:
        """:meth:`shard_location`, reached as the manifest is (its options and timeouts)."""
        return self.where.at(self.shard_location(shard))

    def sample_key(self, shard: int | ShardEntry, index: int) -> int:
        """The key sample ``index`` (dataset-wide) has inside ``shard``: the index itself,
        or in a dataset of several partitions, its index within the shard's partition."""
        entry = self.shards[shard] if isinstance(shard, int) else shard
        if entry.partition is None or self.partitions is None:
            return index
        return index - self.partitions[entry.partition].first_sample

    def shard_of_sample(self, index: int) -> tuple[int, int]:
        """(shard number, position inside it) of global sample ``index``."""
        for i, s in enumerate(self.shards):
            if s.first_sample <= index < s.first_sample + s.samples:
                return i, index - s.first_sample
        raise RangeError(f"sample {index} is not in this dataset ({self.num_samples} samples)")

    @property
    def held_modalities(self) -> list[str]:
        """The modalities with tokens in this dataset, in token-space order."""
        return [m for m in self.token_space.modalities if self.tokens.get(m, 0) > 0]

    def sample_tokens(self) -> np.ndarray:
        """Real tokens of each modality in each sample: int64 ``[num_samples, modalities]``
        (columns in token-space order), from ``modality_runs`` (or, for a dataset of one
        modality, from the packing rule: every sample full but the last)."""
        n, mods = self.seq_len, self.token_space.modalities
        out = np.zeros((self.num_samples, len(mods)), dtype=np.int64)
        if self.modality_runs is None:
            held = self.held_modalities
            if len(held) != 1:
                raise ManifestError(
                    f"manifest {self.location}: records no per-sample modality counts "
                    "(written by an older prepare); prepare it again to weight its modalities"
                )
            col = out[:, mods.index(held[0])]
            col[:] = n
            col[-1] -= self.pad_tokens
            return out
        # each partition's stream starts a sample of its own
        parts = self.partitions or [
            PartitionEntry(
                first_input=0,
                inputs=0,
                input_bytes=0,
                first_sample=0,
                samples=self.num_samples,
                first_doc_id=0,
                documents=0,
                runs=len(self.modality_runs),
            )
        ]
        r0 = 0
        for part in parts:
            runs = self.modality_runs[r0 : r0 + part.runs]
            r0 += part.runs
            if not runs or not part.samples:
                continue
            lengths = np.array([t for _, t in runs], dtype=np.int64)
            which = np.array([mods.index(m) for m, _ in runs], dtype=np.int64)
            ends = np.concatenate([[0], np.cumsum(lengths)])
            bounds = np.arange(part.samples + 1, dtype=np.int64) * n
            rows = out[part.first_sample : part.first_sample + part.samples]
            for k in range(len(mods)):
                # tokens of modality k before stream position x: piecewise linear in x
                cum = np.concatenate([[0], np.cumsum(np.where(which == k, lengths, 0))])
                at = np.interp(bounds, ends, cum)
                rows[:, k] = np.diff(np.rint(at).astype(np.int64))
        return out

    def check_token_space(self, space: TokenSpace) -> None:
        """Refuse a model whose token space differs from the data's."""
        if space != self.token_space:
            raise ManifestError(
                f"manifest {self.location}: the data's {self.token_space.describe()} differs "
                f"from the model's {space.describe()}"
            )

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "name": self.name,
            "token_space": self.token_space.to_dict(),
            "tokenizers": self.tokenizers,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "num_samples": self.num_samples,
            "num_documents": self.num_documents,
            "tokens": self.tokens,
            "pad_tokens": self.pad_tokens,
            "shards": [s.to_dict() for s in self.shards],
            "inputs": [i.to_dict() for i in self.inputs],
            "config": self.config,
            **(
                {"modality_runs": [[m, t] for m, t in self.modality_runs]}
                if self.modality_runs is not None
                else {}
            ),
            **(
                {"partitions": [p.to_dict() for p in self.partitions]}
                if self.partitions is not None
                else {}
            ),
            **({"sample_pairs": self.sample_pairs} if self.sample_pairs is not None else {}),
        }

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n").encode()

    def save(self, where: storage.Location | str) -> None:
        """Write atomically (temporary name, then rename or move)."""
        where = storage.as_location(where)
        self.validate(where.url)
        where.atomic_write(self.to_json())
        self.where = where

    @classmethod
    def load(
        cls,
        where: storage.Location | str,
        max_bytes: int = MAX_MANIFEST_BYTES,
    ) -> Manifest:
        """Read and validate ``manifest.json`` from a path or URL (a dataset directory works
        too). A remote read has ``where``'s timeouts (connect, read seconds; default
        :data:`READ_TIMEOUTS`): a server that accepts and then stalls is one error, not a
        hang. A body over ``max_bytes`` is refused before it is read whole (its size
        checked first, the read stopped past the cap)."""
        where = storage.as_location(where)
        if where.timeouts is None:
            where = where.with_timeouts(READ_TIMEOUTS)
        if not where.url.endswith(".json"):
            where = where.join(MANIFEST_NAME)
        location = where.url
        try:
            raw = where.read_bytes_capped(max_bytes)
        except storage.TooLargeError as e:
            raise ManifestError(
                f"manifest {location}: {e} (data.max_manifest_bytes); is it a manifest?"
            ) from None
        except (OSError, ValueError) as e:
            raise ManifestError(f"cannot read manifest {location}: {_read_failure(e)}") from e
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest {location}: not valid JSON: {e}") from e
        m = cls.from_dict(data, location)
        m.where = where
        return m

    @classmethod
    def from_dict(cls, data: Any, where: str = "manifest") -> Manifest:
        def fail(msg: str) -> ManifestError:
            return ManifestError(f"manifest {where}: {msg}")

        if not isinstance(data, dict):
            raise fail(f"the top level must be an object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise fail(f"format is {data.get('format')!r}, expected {FORMAT!r}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise fail(
                f"format_version {version!r} is not supported (this reader: {FORMAT_VERSION})"
            )
        required = {
            "name": str,
            "token_space": dict,
            "tokenizers": dict,
            "seq_len": int,
            "dtype": str,
            "num_samples": int,
            "num_documents": int,
            "tokens": dict,
            "pad_tokens": int,
            "shards": list,
            "inputs": list,
            "config": dict,
        }
        for key, tp in required.items():
            if key not in data:
                raise fail(f"missing key {key!r}")
            if not isinstance(data[key], tp) or (tp is int and isinstance(data[key], bool)):
                raise fail(f"{key} must be {tp.__name__}, got {type(data[key]).__name__}")
        try:
            space = TokenSpace.from_dict(data["token_space"])
        except ValueError as e:
            raise fail(f"token_space: {e}") from e
        try:
            shards = [
                ShardEntry(
                    url=str(s["url"]),
                    samples=_int(s["samples"]),
                    first_sample=_int(s["first_sample"]),
                    bytes=_int(s["bytes"]),
                    sha256=str(s["sha256"]),
                    partition=None if s.get("partition") is None else _int(s["partition"]),
                )
                for s in data["shards"]
            ]
            inputs = [InputEntry.from_dict(i) for i in data["inputs"]]
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"malformed shard or input entry: {e!r}") from e
        runs = data.get("modality_runs")
        try:  # each a [modality, tokens] pair
            modality_runs = None if runs is None else [(str(m), _int(t)) for m, t in runs]
        except (TypeError, ValueError) as e:
            raise fail(f"modality_runs must be [modality, tokens] pairs: {e!r}") from e
        pairs = data.get("sample_pairs")
        if pairs is not None and not isinstance(pairs, list):
            raise fail(f"sample_pairs must be a list of integers, got {type(pairs).__name__}")
        try:
            sample_pairs = None if pairs is None else [_int(p) for p in pairs]
        except (TypeError, ValueError) as e:
            raise fail(f"sample_pairs must be a list of integers: {e!r}") from e
        parts = data.get("partitions")
        try:
            partitions = None if parts is None else [PartitionEntry.from_dict(p) for p in parts]
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"malformed partition entry: {e!r}") from e
        m = cls(
            name=data["name"],
            token_space=space,
            tokenizers=data["tokenizers"],
            seq_len=data["seq_len"],
            shards=shards,
            inputs=inputs,
            num_documents=data["num_documents"],
            tokens={str(k): _int(v) for k, v in data["tokens"].items()},
            pad_tokens=data["pad_tokens"],
            config=data["config"],
            modality_runs=modality_runs,
            partitions=partitions,
            sample_pairs=sample_pairs,
        )
        if data["dtype"] != m.dtype:
            raise fail(f"dtype {data['dtype']!r} does not match the token space ({m.dtype})")
        if data["num_samples"] != m.num_samples:
            raise fail(
                f"num_samples {data['num_samples']} != {m.num_samples} summed over the shards"
            )
        m.validate(where)
        return m

    def validate(self, where: str = "manifest") -> None:
        """Internal consistency; raises ManifestError naming ``where``."""

        def fail(msg: str) -> ManifestError:
            return ManifestError(f"manifest {where}: {msg}")

        if self.seq_len < 1:
            raise fail(f"seq_len must be >= 1, got {self.seq_len}")
        expected_first = 0
        for i, s in enumerate(self.shards):
            if s.samples < 1 or s.bytes < 1:
                raise fail(f"shard {i} ({s.url}) has {s.samples} samples and {s.bytes} bytes")
            if s.first_sample != expected_first:
                raise fail(
                    f"shard {i} ({s.url}) starts at sample {s.first_sample}, expected {expected_first}"
                )
            if not _SHA_RE.match(s.sha256):
                raise fail(f"shard {i} ({s.url}) sha256 {s.sha256!r} is not 64 hex digits")
            expected_first += s.samples
        unknown = set(self.tokens) - set(self.token_space.modalities)
        if unknown:
            raise fail(f"tokens counted for modalities {sorted(unknown)} not in the token space")
        total = sum(self.tokens.values()) + self.pad_tokens
        if total != self.num_samples * self.seq_len:
            raise fail(
                f"tokens ({sum(self.tokens.values())}) + pad ({self.pad_tokens}) != "
                f"num_samples × seq_len ({self.num_samples} × {self.seq_len})"
            )
        for i, entry in enumerate(self.inputs):
            if entry.status not in ("ok", "skipped"):
                raise fail(f"input {i} ({entry.source}) has status {entry.status!r}")
        if self.modality_runs is not None:
            per: dict[str, int] = {}
            for i, (m, t) in enumerate(self.modality_runs):
                if m not in self.token_space.modalities or t < 1:
                    raise fail(f"modality_runs[{i}] = [{m!r}, {t}] is not a modality and a count")
                per[m] = per.get(m, 0) + t
            if per != {m: t for m, t in self.tokens.items() if t}:
                raise fail(f"modality_runs sum to {per}, tokens says {self.tokens}")
        if self.sample_pairs is not None:
            most = self.seq_len * (self.seq_len + 1) // 2
            if len(self.sample_pairs) != self.num_samples:
                raise fail(
                    f"sample_pairs holds {len(self.sample_pairs)} figures for "
                    f"{self.num_samples} samples"
                )
            bad = [i for i, p in enumerate(self.sample_pairs) if not 0 <= p <= most]
            if bad:
                raise fail(
                    f"sample_pairs[{bad[0]}] = {self.sample_pairs[bad[0]]} is outside "
                    f"[0, {most}] (seq_len {self.seq_len})"
                )
        docs = sum(e.documents for e in self.inputs if e.status == "ok")
        if docs != self.num_documents:
            raise fail(f"inputs hold {docs} documents, num_documents says {self.num_documents}")
        if self.partitions is not None:
            self._validate_partitions(fail)

    def _validate_partitions(self, fail: Any) -> None:
        parts = self.partitions or []
        first_sample = first_doc = first_input = runs = 0
        for i, p in enumerate(parts):
            if (p.first_sample, p.first_doc_id, p.first_input) != (
                first_sample,
                first_doc,
                first_input,
            ):
                raise fail(f"partition {i} does not start where partition {i - 1} ends")
            first_sample += p.samples
            first_doc += p.documents
            first_input += p.inputs
            runs += p.runs
        if first_sample != self.num_samples or first_doc != self.num_documents:
            raise fail("the partitions' samples or documents do not add up to the dataset's")
        if self.modality_runs is not None and runs != len(self.modality_runs):
            raise fail(
                f"the partitions hold {runs} modality runs, the dataset {len(self.modality_runs)}"
            )
        for i, s in enumerate(self.shards):
            k = s.partition
            if k is None or not 0 <= k < len(parts):
                raise fail(f"shard {i} ({s.url}) names no partition of the {len(parts)}")
            part = parts[k]
            if not part.first_sample <= s.first_sample < part.first_sample + part.samples:
                raise fail(f"shard {i} ({s.url}) lies outside its partition {k}")


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


# -------------------------------------------------------------- shard integrity


def verify_shard_bytes(entry: ShardEntry, data: bytes, where: str = "") -> None:
    """Raise ShardIntegrityError unless ``data`` has the entry's size and sha256."""
    where = where or entry.url
    if len(data) != entry.bytes:
        raise ShardIntegrityError(
            f"shard {where}: {len(data)} bytes, the manifest says {entry.bytes} (truncated or replaced)"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ShardIntegrityError(
            f"shard {where}: sha256 {digest[:16]}…, the manifest says {entry.sha256[:16]}…"
        )


def read_shard(where: storage.Location | str) -> bytes:
    """A shard's bytes. A remote read has ``where``'s timeouts (connect, read seconds;
    default :data:`READ_TIMEOUTS`), as the manifest's: a server that accepts and then
    stalls is one error, not a hang."""
    where = storage.as_location(where)
    if where.timeouts is None:
        where = where.with_timeouts(READ_TIMEOUTS)
    try:
        return where.read_bytes()
    except (OSError, ValueError) as e:
        raise ShardIntegrityError(f"cannot read shard {where.url}: {_read_failure(e)}") from e


def read_verified_shard(
    manifest: Manifest, shard: int | ShardEntry, timeouts: tuple[float, float] = READ_TIMEOUTS
) -> bytes:
    """A shard's bytes, read from wherever the manifest points and checked against it."""
    entry = manifest.shards[shard] if isinstance(shard, int) else shard
    where = manifest.shard_where(entry).with_timeouts(timeouts)
    data = read_shard(where)
    verify_shard_bytes(entry, data, where.url)
    return data


def _read_failure(e: BaseException) -> str:
    """Why a read failed, in one line (a remote failure is already one storage.ReadError)."""
    return str(e) if isinstance(e, storage.ReadError) else first_line(e)
