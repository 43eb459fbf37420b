"""Our shards as a dataset for the Hugging Face stack: the training loader's order, in the
fields transformers models and their sequence-parallel adapters read.

:class:`ShardDataset` is a ``torch.utils.data.IterableDataset`` over one manifest or a
weighted ``data.train`` mixture. Underneath is the training loader itself
(:class:`~ulysses_mm.loader.stream.ShardStream`): the same global order (a function of
seed and epoch), mixing, node cache and prefetch thread, and its resumable state. Each
item is one packed sample as :mod:`ulysses_mm.hf.inputs` describes (``input_ids``,
``position_ids`` restarting at every document, ``labels``, ``shift_labels``); the pad
tail is one span of positions of its own, so it is a document whose targets are ignored.

Who reads what. ``readers`` is how many data-parallel ways the samples are split (it fixes
the order: one source drops an epoch's tail shorter than ``readers × micro_batch``):

- ``reader=r``: this process yields reader r's ``micro_batch`` positions of every global
  micro-batch, exactly what our loader gives DP rank r. Every SP rank of a DP group uses
  the same r and so reads the same samples (then keeps its slice,
  :func:`~ulysses_mm.hf.inputs.shard_inputs`). For loops that do not pass the loader
  through ``accelerator.prepare``.
- ``reader=None``: the whole global stream, in order, for Accelerate to split: its
  dispatcher and its ``IterableDatasetShard`` both hand process i the i-th ``micro_batch``
  of every ``readers × micro_batch`` items, i.e. reader i's positions. Under Accelerate's
  DeepSpeed sequence parallelism every process is a reader (``readers`` = world size):
  DeepSpeed's ``UlyssesSPDataLoaderAdapter`` gathers the samples of an SP group's ranks
  and the group trains on each in turn.

State. :meth:`ShardDataset.state_dict` is where the stream stands after the items yielded
so far (the loader's state and how many items of the current stream batch were taken),
so torchdata's ``StatefulDataLoader`` (Accelerate's ``use_stateful_dataloader``) and
``accelerator.register_for_checkpointing`` save it as is; :meth:`state_after` is the
state after any number of items from the last start, which is what a trainer that
prefetches needs (:class:`~ulysses_mm.hf.trainer.ShardStateCallback`). Loading a state
made on other shards, seed or weights fails in one line.

:func:`hf_dataset` is the same stream as a ``datasets.IterableDataset`` with one shard
per reader, so ``datasets.distributed.split_dataset_by_node`` and Accelerate give
process r reader r's samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ulysses_mm.config import DataConfig, RunConfig, from_dict
from ulysses_mm.core.errors import ConfigError, DataError, UnsupportedError
from ulysses_mm.core.format import IGNORE, PackedSample, segments_to_ids
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader import state as loader_state
from ulysses_mm.loader.batch import make_labels
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import Sources
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.shards.manifest import Manifest
from ulysses_mm.train.plan import train_entries

FIELDS = ("input_ids", "position_ids", "labels", "shift_labels")
_SPAN_CHUNK = 1 << 20  # positions the order is advanced by at a time in state_after


def sample_fields(sample: PackedSample, space: TokenSpace) -> dict[str, np.ndarray]:
    """One packed sample in the HF convention (int64 arrays [N])."""
    tokens = np.asarray(sample.tokens, dtype=np.int64)
    n = len(tokens)
    doc, pos = segments_to_ids(sample.segments, n)
    pads = np.flatnonzero(doc < 0)  # the tail no segment covers: one span of positions
    pos[pads] = np.arange(len(pads))
    step = np.diff(pos) != 1
    if not np.array_equal(step, doc[1:] != doc[:-1]):
        t = int(np.flatnonzero(step != (doc[1:] != doc[:-1]))[0]) + 1
        raise DataError(
            f"sample {sample.index}: the document starting at token {t} continues the "
            "previous one's positions, so position_ids cannot tell them apart"
        )
    shift, _ = make_labels(tokens[None], doc[None], space)
    labels = np.full(n, IGNORE, dtype=np.int64)
    labels[1:] = shift[0, :-1]
    return {"input_ids": tokens, "position_ids": pos, "labels": labels, "shift_labels": shift[0]}


def _load_sources(
    sources: Sources | str | Mapping[str, Any], data: DataConfig
) -> tuple[Sources, TokenSpace]:
    """Manifests (with weights) from a location, a ``data.train`` mapping, or what
    :class:`ShardStream` takes; every manifest must share the first one's token space."""
    if isinstance(sources, (str, Mapping)):
        sources = [
            (Manifest.load(data.location(loc), data.max_manifest_bytes), w, m)
            for loc, w, m in train_entries(
                RunConfig(data=from_dict(DataConfig, {"train": sources}))
            )
        ]
    manifests = [sources] if isinstance(sources, Manifest) else [e[0] for e in sources]
    space = manifests[0].token_space
    for m in manifests[1:]:
        m.check_token_space(space)
    return sources, space


class ShardDataset(IterableDataset):
    """Packed samples of our shards in the HF convention, in the training loader's order
    (see the module docstring for ``readers`` / ``reader``)."""

    def __init__(
        self,
        sources: Sources | str | Mapping[str, Any],
        micro_batch: int = 1,
        readers: int = 1,
        reader: int | None = None,
        data: DataConfig | None = None,
    ) -> None:
        """``sources``: a manifest location, a ``data.train`` mapping ({location: weight
        or {weight, modalities}}), a :class:`Manifest` or ``[(manifest, weight), ...]``.
        ``data`` gives the order and fetch settings (seed, shuffle, prefetch, node cache,
        storage options); its ``train`` is not read."""
        super().__init__()
        if readers < 1 or micro_batch < 1:
            raise ConfigError(f"readers and micro_batch must be >= 1, got {readers}, {micro_batch}")
        if reader is not None and not 0 <= reader < readers:
            raise ValueError(f"reader {reader} is outside readers={readers}")
        d = data or DataConfig()
        self.sources, self.space = _load_sources(sources, d)
        self.micro_batch, self.readers, self.reader = micro_batch, readers, reader
        self.options = StreamOptions.from_config(d)
        self.cache = NodeCache(d.cache_dir, d.cache_bytes) if d.cache_dir else None
        # the whole stream is one reader taking every global micro-batch
        split = (0, 1) if reader is None else (reader, readers)
        self.stream = ShardStream(self.sources, *split, self.batch_items, self.options, self.cache)
        self._pending: list[PackedSample] = []
        self._taken = 0  # items of _pending yielded
        self._before: dict[str, Any] | None = None  # the stream's state before _pending
        self._base = (self.stream.cursor, 0)  # where counting for state_after starts

    @classmethod
    def from_config(
        cls, cfg: RunConfig | DataConfig, readers: int = 1, reader: int | None = None
    ) -> ShardDataset:
        """The dataset of a run config's ``data.train`` (its manifests, weights, order and
        fetch settings, ``data.micro_batch_size``)."""
        d = cfg.data if isinstance(cfg, RunConfig) else cfg
        return cls(d.train, d.micro_batch_size, readers, reader, d)

    @property
    def batch_items(self) -> int:
        """Items of one stream step: a global micro-batch (whole stream) or this
        reader's share of it."""
        return self.micro_batch * (self.readers if self.reader is None else 1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise UnsupportedError(
                "ShardDataset is one ordered stream (shards are fetched ahead on a thread): "
                "use DataLoader num_workers 0 or 1"
            )
        while True:
            if self._taken >= len(self._pending):
                self._before = self.stream.state_dict()
                skip = self._taken if not self._pending else 0
                self._pending = self.stream.next_batch()
                self._taken = skip
            sample = self._pending[self._taken]
            self._taken += 1
            yield {k: torch.from_numpy(v) for k, v in sample_fields(sample, self.space).items()}

    def close(self) -> None:
        """Stop the prefetch thread (it never blocks the process's exit)."""
        self.stream.close()

    # ----------------------------------------------------------------- state
    def _state(self, cursor_state: dict[str, Any], taken: int) -> dict[str, Any]:
        return {"loader": cursor_state, "taken": int(taken), "batch_items": self.batch_items}

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands after the items yielded so far (no layout but the
        items per stream step)."""
        if self._pending and self._taken < len(self._pending):
            assert self._before is not None
            return self._state(self._before, self._taken)
        return self._state(self.stream.state_dict(), self._taken if not self._pending else 0)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Continue from ``saved`` (refused in one line if it belongs to other shards,
        seed, shuffle or weights, or to another split)."""
        taken = self._check_state(saved)
        try:
            self.stream.load_state_dict(dict(saved["loader"]))
        except DataError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed loader state
            raise DataError(f"the saved data state's loader is not a loader state: {e!r}") from None
        self._pending, self._before = [], None
        self._taken = taken  # skipped in the next stream batch
        self._base = (self.stream.cursor, self._taken)

    def _check_state(self, saved: Any) -> int:
        """``saved``'s ``taken``, once ``saved`` has this dataset's schema: a mapping of
        ``loader`` (a mapping), ``taken`` (0 <= taken < batch_items: items of the next
        stream batch already yielded) and ``batch_items`` (this dataset's); else one
        :class:`DataError` line."""
        if not isinstance(saved, Mapping):
            raise DataError(f"the saved data state is a {type(saved).__name__}, not a mapping")
        missing = [k for k in ("loader", "taken") if k not in saved]
        if missing:
            raise DataError(
                f"the saved data state lacks {', '.join(missing)} (it has: "
                f"{', '.join(map(str, saved)) or 'nothing'})"
            )
        items = saved.get("batch_items", self.batch_items)
        if not _is_int(items) or items != self.batch_items:
            raise DataError(
                f"the saved data state steps {items!r} items at a time, this "
                f"dataset {self.batch_items} (readers × micro_batch differ)"
            )
        if not isinstance(saved["loader"], Mapping):
            raise DataError(
                f"the saved data state's loader is a {type(saved['loader']).__name__}, "
                "not a mapping"
            )
        taken = saved["taken"]
        if not _is_int(taken) or not 0 <= taken < self.batch_items:
            raise DataError(
                f"the saved data state's taken is {taken!r}: it must be an integer in "
                f"[0, {self.batch_items}) (items of a stream batch of {self.batch_items})"
            )
        return int(taken)

    def state_after(self, items: int) -> dict[str, Any]:
        """The state after ``items`` items from the construction or the last
        :meth:`load_state_dict`, whatever was read ahead since."""
        cursor, taken = self._base
        steps, taken = divmod(taken + int(items), self.batch_items)
        order = self.stream.order
        left = steps * order.global_batch
        while left > 0:
            n = min(left, _SPAN_CHUNK)
            cursor = order.span(cursor, n)[2]
            left -= n
        return self._state(loader_state.state_dict(order, cursor), taken)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _generate(
    sources: Any, micro_batch: int, readers: int, reader: Sequence[int], data: DataConfig
) -> Iterator[dict[str, list[int]]]:
    for r in reader:  # one shard of the datasets.IterableDataset per reader
        ds = ShardDataset(sources, micro_batch, readers, r, data)
        try:  # the stream is endless: its prefetch thread stops when the consumer does
            for item in ds:
                yield {k: v.tolist() for k, v in item.items()}
        finally:
            ds.close()


def hf_dataset(
    sources: str | Mapping[str, Any],
    micro_batch: int = 1,
    readers: int = 1,
    data: DataConfig | None = None,
):
    """The stream as a ``datasets.IterableDataset`` (torch format) with one shard per
    reader: reader r's samples are shard r, so ``split_dataset_by_node(ds, rank=r,
    world_size=readers)``, and Accelerate with ``dispatch_batches=False`` (which then
    shards a datasets stream by process), give process r what ``ShardDataset(...,
    reader=r)`` gives. Unsplit, it is reader 0's endless stream. Resuming uses datasets'
    own ``state_dict`` (it replays the shard up to its example)."""
    if readers < 1 or micro_batch < 1:  # as ShardDataset refuses them
        raise ConfigError(f"readers and micro_batch must be >= 1, got {readers}, {micro_batch}")
    import datasets  # lazy: heavy (datasets)

    ints = datasets.Sequence(datasets.Value("int64"))
    features = datasets.Features({k: ints for k in FIELDS})
    stream = datasets.IterableDataset.from_generator(
        _generate,
        features=features,
        gen_kwargs={
            "sources": sources,
            "micro_batch": micro_batch,
            "readers": readers,
            "reader": list(range(readers)),
            "data": data or DataConfig(),
        },
    )
    return stream.with_format("torch")
