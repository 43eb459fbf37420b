"""Partitions: the unit of work of ``prepare``, the same on every engine.

The sorted input list is cut into contiguous partitions by :func:`partition_inputs`, a
function of the inputs' sizes alone (so of the sorted list and the sizes: never of the
engine, the number of workers or the order they finish in). Each partition is tokenized,
packed and written on its own (:func:`ulysses_mm.shards.prepare.assemble.write_partition`),
starting a fresh sample stream: its sample keys and document ids count from 0 and its last
sample is padded. A dataset of one partition is laid out as a plain dataset
(``shard-000000.tar`` …); with more, partition ``p`` writes ``part-PPPPP/shard-NNNNNN.tar``
and the manifest records where each partition's samples and documents start.

When a partition's shards are all published it writes a *fragment*,
``OUTPUT/_partitions/part-PPPPP.json`` (its inputs' outcomes, its shards with their
sha256, its counts), atomically and last. A rerun whose partition has a fragment with the
same key (its inputs' identities, the data-shaping config, the token space) and whose
shards all still match their sha256 takes the fragment instead of redoing the partition;
this is how a killed run resumes, on any engine. The fragments go once the manifest is
written.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ulysses_mm.core import storage
from ulysses_mm.shards.manifest import InputEntry
from ulysses_mm.shards.prepare.pool import WorkerConfig
from ulysses_mm.shards.writer import ShardRecord

FRAGMENT_VERSION = 1
FRAGMENTS_DIR = "_partitions"


def partition_inputs(
    sizes: Sequence[int], partition_bytes: int, partitions: int = 0
) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of the inputs (in their sorted order).

    ``partitions`` > 0: that many ranges (fewer if there are fewer inputs), cut where the
    running total of bytes crosses each ``k / partitions`` of the whole (an input goes to
    the part its middle byte falls in). Else by ``partition_bytes``: a new range starts
    when the next input would take the current one past it (an input bigger than that
    has a range of its own); 0 = one range."""
    n = len(sizes)
    if n == 0:
        return []
    if partitions > 0:
        total = sum(sizes)
        parts, cum = [], 0
        for i, s in enumerate(sizes):
            if total:  # the part holding the input's middle byte, in exact integers
                parts.append(min(partitions - 1, (2 * cum + s) * partitions // (2 * total)))
            else:
                parts.append(i * partitions // n)
            cum += s
        cuts = [i for i in range(1, n) if parts[i] != parts[i - 1]]
    elif partition_bytes > 0:
        cuts, filled = [], 0
        for i, s in enumerate(sizes):
            if i and filled + s > partition_bytes:
                cuts.append(i)
                filled = 0
            filled += s
    else:
        cuts = []
    bounds = [0, *cuts, n]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every partition of a run is done with (picklable: it travels to the workers)."""

    worker: WorkerConfig
    suffixes: dict[str, list[str]]  # the pipeline's extra routing table
    output: storage.Location  # the dataset's directory or URL, with its storage options
    staging: str  # local staging directory, on the node that runs a partition
    seq_len: int
    max_bytes: int
    max_samples: int
    multi: bool  # more than one partition
    keep_staging: bool
    data_key: str  # of the data-shaping config, token space and specs (the fragments' key)


@dataclass(frozen=True)
class PartitionTask:
    """One partition: its number and its inputs (with the sizes and identities listed)."""

    index: int
    first_input: int  # of the dataset's sorted input list
    inputs: list[storage.InputFile]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.inputs)

    def key(self, job: Job) -> str:
        """Identifies what this partition's output would be: its fragment's key."""
        ident = {
            "v": FRAGMENT_VERSION,
            "run": job.data_key,  # named so in the hash: earlier fragments keep their keys
            "index": self.index,
            "multi": job.multi,
            "inputs": [[f.location, f.identity] for f in self.inputs],
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        """For errors: the partition and the inputs it holds."""
        names = [f.location.rstrip("/").rsplit("/", 1)[-1] for f in self.inputs]
        which = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return f"partition {self.index} ({len(names)} inputs: {which})"


@dataclass
class PartitionResult:
    """What one partition holds, its sample keys and document ids counted from 0; what
    its fragment records."""

    index: int
    key: str
    entries: list[InputEntry]  # first_doc_id within the partition
    shards: list[ShardRecord]  # names relative to the output, first_sample within it
    documents: int
    samples: int
    counts: list[int]  # real tokens per modality (token-space order)
    spans: list[tuple[int, int]]  # the partition's token stream as (modality index, tokens)
    pairs: list[int] | None  # each sample's causal pairs; None: a fragment written before them
    # how this run got it (not in the fragment)
    reused_inputs: int = 0  # inputs taken from the staging directory
    crashed: list[str] = field(default_factory=list)  # inputs whose worker process died
    resumed: bool = False  # taken whole from an earlier run's fragment

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def to_json(self) -> bytes:
        data = {
            "version": FRAGMENT_VERSION,
            "index": self.index,
            "key": self.key,
            "entries": [e.to_dict() for e in self.entries],
            "shards": [asdict(r) for r in self.shards],
            "documents": self.documents,
            "samples": self.samples,
            "counts": self.counts,
            "runs": [list(r) for r in self.spans],
            **({"pairs": self.pairs} if self.pairs is not None else {}),
        }
        return (json.dumps(data, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PartitionResult:
        d = json.loads(raw)
        if d.get("version") != FRAGMENT_VERSION:
            raise ValueError(f"fragment version {d.get('version')!r}")
        return cls(
            index=int(d["index"]),
            key=str(d["key"]),
            entries=[InputEntry.from_dict(e) for e in d["entries"]],
            shards=[ShardRecord(**r) for r in d["shards"]],
            documents=int(d["documents"]),
            samples=int(d["samples"]),
            counts=[int(c) for c in d["counts"]],
            spans=[(int(m), int(t)) for m, t in d["runs"]],
            pairs=[int(p) for p in d["pairs"]] if "pairs" in d else None,
        )


def fragment_location(output: storage.Location, index: int) -> storage.Location:
    return output.join(FRAGMENTS_DIR).join(f"part-{index:05d}.json")


def save_fragment(job: Job, result: PartitionResult) -> None:
    job.output.join(FRAGMENTS_DIR).makedirs()
    fragment_location(job.output, result.index).atomic_write(result.to_json())


def completed(job: Job, task: PartitionTask) -> PartitionResult | None:
    """The partition as an earlier run left it, if that run finished it for these very
    inputs and config and every one of its shards still has the bytes it recorded."""
    location = fragment_location(job.output, task.index)
    try:
        result = PartitionResult.from_json(location.read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if result.key != task.key(job) or result.index != task.index:
        return None
    for record in result.shards:
        try:
            size, digest = job.output.join(record.name).size_and_sha256()
        except OSError:
            return None
        if size != record.bytes or digest != record.sha256:
            return None
    result.resumed = True
    return result


def remove_fragments(output: storage.Location) -> None:
    where = output.join(FRAGMENTS_DIR)
    for name in where.list_names():
        where.join(name).remove()
    where.remove_empty_dir()
