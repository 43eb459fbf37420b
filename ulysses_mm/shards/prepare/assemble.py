"""The dataset side of ``prepare``: a partition's inputs' documents, taken in input order,
packed into samples and written into the partition's shards, every input recorded.

Workers finish in any order; :class:`InOrder` hands their results on in input order and
:class:`Assembler` packs them in that order, so packing, document ids, shard boundaries and
bytes are a function of the partition's inputs and the config alone.
:func:`write_partition` is the one function that turns a partition's tokenized inputs into
its shards and fragment, whichever engine tokenized them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import numpy as np

from ulysses_mm.core.format import SEG_LENGTH, SEG_MODALITY, PackedSample, sample_pairs
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.shards.manifest import InputEntry
from ulysses_mm.shards.pack import Packer
from ulysses_mm.shards.prepare.partition import Job, PartitionResult, PartitionTask, save_fragment
from ulysses_mm.shards.prepare.publish import Output
from ulysses_mm.shards.prepare.route import Result
from ulysses_mm.shards.prepare.staged import staged_blocks
from ulysses_mm.shards.writer import ShardRecord, ShardWriter

T = TypeVar("T")


class InOrder(Generic[T]):
    """Items by consecutive index 0, 1, 2, …, whatever order they are put in."""

    def __init__(self) -> None:
        self.next = 0
        self._waiting: dict[int, T] = {}

    def put(self, index: int, item: T) -> Iterator[T]:
        """Take ``item``; yield every item now ready, in index order."""
        self._waiting[index] = item
        while self.next in self._waiting:
            yield self._waiting.pop(self.next)
            self.next += 1

    def put_all(self, items: Iterable[tuple[int, T]]) -> Iterator[T]:
        for index, item in items:
            yield from self.put(index, item)


class Assembler:
    """Packs each ok input's documents and writes the samples; records every input."""

    def __init__(self, space: TokenSpace, seq_len: int, writer: ShardWriter) -> None:
        self.packer = Packer(seq_len, space.dtype())
        self.writer = writer
        self.entries: list[InputEntry] = []
        self.counts = np.zeros(len(space.modalities), dtype=np.int64)  # per modality
        # the token stream as spans of one modality: [modality index, tokens]
        self.spans: list[list[int]] = []
        self.pairs: list[int] = []  # each sample's causal pairs (core.format.sample_pairs)

    def add(self, result: Result) -> None:
        """The next input in input order."""
        o = result.outcome
        if not o.ok:
            self.entries.append(InputEntry(o.source, "skipped", reason=o.reason))
            return
        self.entries.append(
            InputEntry(
                o.source,
                "ok",
                modality=o.modality,
                documents=o.documents,
                tokens=o.tokens,
                first_doc_id=self.packer.next_doc,
                skipped_records=o.skipped_records,
                skip_reason=o.skip_reason,
            )
        )
        if result.held is not None:  # tokenized by this process, for it alone
            blocks = result.held.blocks(o.documents, o.source)
        else:
            blocks = staged_blocks(result.staged, o.documents, self.packer.dtype, o.source)
        try:
            for block in blocks:
                self._write(self.packer.add(block))
        finally:
            if result.held is not None:
                result.held.abort()

    def finish(self) -> list[ShardRecord]:
        """The padded last sample written, the last shard closed: every shard's record."""
        self._write(self.packer.finish())
        return self.writer.close()

    def _write(self, samples: Iterator[PackedSample]) -> None:
        for sample in samples:
            seg = sample.segments
            np.add.at(self.counts, seg[:, SEG_MODALITY], seg[:, SEG_LENGTH])
            for m, n in zip(seg[:, SEG_MODALITY].tolist(), seg[:, SEG_LENGTH].tolist()):
                if self.spans and self.spans[-1][0] == m:
                    self.spans[-1][1] += n
                else:
                    self.spans.append([m, n])
            self.pairs.append(sample_pairs(seg))
            self.writer.write(sample)


def write_partition(
    job: Job,
    task: PartitionTask,
    space: TokenSpace,
    results: Iterable[Result],
    on_input: Callable[[Result], None] | None = None,
) -> PartitionResult:
    """Pack a partition's inputs (``results``, one per input in input order) into its
    shards, publish them, write its fragment; what it holds. ``on_input`` is called after
    each input (progress)."""
    output = Output(job.output, job.staging, task.index, job.multi)
    writer = ShardWriter(
        output.write_dir,
        output.publish,
        job.max_bytes,
        job.max_samples,
        prefix=output.prefix,
    )
    assembler = Assembler(space, job.seq_len, writer)
    reused, crashed = 0, []
    try:
        for done in results:
            assembler.add(done)
            reused += done.reused
            if done.outcome.crashed:
                crashed.append(done.outcome.source)
            if on_input is not None:
                on_input(done)
        records = assembler.finish()
    except BaseException:
        writer.abort()
        raise
    if len(assembler.entries) != len(task.inputs):
        raise RuntimeError(
            f"partition {task.index}: {len(assembler.entries)} results for {len(task.inputs)} inputs"
        )
    result = PartitionResult(
        index=task.index,
        key=task.key(job),
        entries=assembler.entries,
        shards=records,
        documents=assembler.packer.next_doc,
        samples=assembler.packer.next_sample,
        counts=[int(c) for c in assembler.counts],
        spans=[(m, t) for m, t in assembler.spans],
        pairs=assembler.pairs,
        reused_inputs=reused,
        crashed=crashed,
    )
    save_fragment(job, result)
    return result
