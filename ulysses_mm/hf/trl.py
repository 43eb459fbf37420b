"""TRL's ``SFTTrainer`` on our shards: the stream as the dataset it accepts, the data
state in every checkpoint, and the settings under which it would silently train on
something else refused before the first step.

:func:`trl_dataset` is the whole stream of a :class:`~ulysses_mm.hf.dataset.ShardDataset`
(``reader=None``, ``readers`` = world size) as a one-shard ``datasets.IterableDataset``,
which Accelerate splits over the processes as it splits our torch dataset. Its columns are
the ones TRL's collator keeps: ``input_ids``, ``labels`` and ``seq_lengths`` (the packed
documents' lengths, the pad tail one more), from which the collator rebuilds position ids
that restart at every document. Every ``iter()`` starts the stream where the run starts
(``SFTTrainer`` reads one sample at construction); the ``ShardDataset`` travels by a
handle that ``datasets``' fingerprinting and copies keep by reference.

:class:`SFTShardCallback` (``callbacks=sft_callbacks(dataset)``) is
:class:`~ulysses_mm.hf.trainer.ShardStateCallback` for that dataset, which also raises a
:class:`~ulysses_mm.core.errors.ConfigError` when the trainer is built with

- ``max_length`` shorter than our samples (TRL truncates every sample to it),
- ``packing=True`` (TRL re-packs whole samples, erasing the documents),
- ``padding_free=True`` (DeepSpeed's SP adapter cannot shard the flat batch),
- ``completion_only_loss=True`` (our samples carry no completion mask),
- ``shuffle_dataset=True`` (a shuffle buffer reads ahead of the saved data state),
- no sequence parallelism (TRL's collator then sends no position ids, so documents
  attend to each other),
- transformers' SDPA as DeepSpeed's SP core (it attends across documents): call
  :func:`~ulysses_mm.hf.attention.isolate_documents` first.

The SP size is read from the Accelerator's state, so it is right whether it came from
``SFTConfig(parallelism_config=...)`` or ``accelerate launch --config_file``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface

from ulysses_mm.config import DataConfig
from ulysses_mm.core.errors import ConfigError
from ulysses_mm.hf.attention import Backend
from ulysses_mm.hf.dataset import ShardDataset
from ulysses_mm.hf.trainer import ShardStateCallback, parallelism_config, sp_size

TRL_FIELDS = ("input_ids", "labels", "seq_lengths")
_LIVE: dict[int, ShardDataset] = {}  # handle key -> dataset, in this process
_BY_STREAM: dict[int, tuple[Any, ShardDataset]] = {}  # id(trl_dataset) -> it, its dataset


def seq_lengths(position_ids: torch.Tensor | np.ndarray) -> list[int]:
    """The lengths of the spans of consecutive positions (documents, then the pad tail)."""
    pos = np.asarray(position_ids)
    starts = np.flatnonzero(np.diff(pos) != 1) + 1
    return np.diff(np.concatenate([[0], starts, [len(pos)]])).tolist()


class _Handle:
    """A :class:`ShardDataset` passed by reference through ``datasets``: it pickles (for
    the fingerprint) and copies as its key, which names the live dataset of this process."""

    def __init__(self, dataset: ShardDataset) -> None:
        self.key = id(dataset)
        _LIVE[self.key] = dataset

    @property
    def dataset(self) -> ShardDataset:
        return _LIVE[self.key]

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _handle, (self.key,)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Handle:
        return self


def _handle(key: int) -> _Handle:
    h = _Handle.__new__(_Handle)
    h.key = key
    return h


def _generate(handle: _Handle) -> Iterator[dict[str, list[int]]]:
    ds = handle.dataset
    ds.load_state_dict(ds.state_after(0))  # from the run's start, whatever was read before
    for item in ds:
        yield {
            "input_ids": item["input_ids"].tolist(),
            "labels": item["labels"].tolist(),
            "seq_lengths": seq_lengths(item["position_ids"]),
        }


def trl_dataset(
    sources: str | Mapping[str, Any],
    micro_batch: int = 1,
    readers: int | None = None,
    data: DataConfig | None = None,
):
    """The whole stream as a ``datasets.IterableDataset`` for ``SFTTrainer``
    (``readers``: the processes, by default ``WORLD_SIZE``; ``micro_batch``: the
    ``per_device_train_batch_size``). :func:`shard_dataset` gives the ``ShardDataset``."""
    import datasets  # lazy: heavy (datasets)

    if readers is None:  # 0 is ShardDataset's to refuse, not a default
        readers = int(os.environ.get("WORLD_SIZE", "1"))
    shards = ShardDataset(sources, micro_batch, readers=readers, reader=None, data=data)
    ints = datasets.Sequence(datasets.Value("int64"))
    stream = datasets.IterableDataset.from_generator(
        _generate,
        features=datasets.Features({k: ints for k in TRL_FIELDS}),
        gen_kwargs={"handle": _Handle(shards)},
    )
    _BY_STREAM[id(stream)] = (stream, shards)  # the stream kept alive: its id stays its own
    return stream


def shard_dataset(stream: Any) -> ShardDataset:
    """The :class:`ShardDataset` behind a :func:`trl_dataset` stream."""
    try:
        return _BY_STREAM[id(stream)][1]
    except KeyError:
        raise ConfigError("give the dataset trl_dataset(...) returned") from None


def check_sft_config(args: Any, seq_len: int) -> None:
    """Refuse the ``SFTConfig`` settings under which TRL would silently train on
    something else than our samples (see the module docstring)."""
    if getattr(args, "packing", False):
        raise ConfigError(
            "SFTConfig(packing=True) re-packs our packed samples and erases their documents: "
            "set packing=False"
        )
    if getattr(args, "padding_free", False):
        raise ConfigError(
            "SFTConfig(padding_free=True) is not supported by DeepSpeed's sequence-parallel "
            "adapter and our samples need no padding: set padding_free=False"
        )
    if getattr(args, "completion_only_loss", None):
        raise ConfigError(
            "SFTConfig(completion_only_loss=True) needs a completion mask, which our samples do "
            "not have (their labels say what is trained): set completion_only_loss=None"
        )
    if getattr(args, "shuffle_dataset", False):
        raise ConfigError(
            "SFTConfig(shuffle_dataset=True) reorders the stream through a buffer read ahead, "
            "so the saved data state no longer says what was trained: set shuffle_dataset="
            "False (the order is the loader's: DataConfig seed and shuffle)"
        )
    max_length = getattr(args, "max_length", None)
    if max_length is not None and max_length < seq_len:
        raise ConfigError(
            f"SFTConfig(max_length={max_length}) would cut every {seq_len}-token sample: "
            "set max_length=None"
        )
    pc = parallelism_config(args)
    if sp_size(args) < 2:
        raise ConfigError(
            "without sequence parallelism TRL's collator passes no position ids, so packed "
            "documents attend to each other: use sp_size >= 2, or examples/hf_trainer.py"
        )
    core = getattr(getattr(pc, "sp_handler", None), "sp_attn_implementation", None) or "sdpa"
    if core == "sdpa" and not isinstance(AttentionInterface._global_mapping.get(core), Backend):
        raise ConfigError(
            "DeepSpeed's SP core is transformers' sdpa, which attends across packed "
            'documents: call ulysses_mm.hf.isolate_documents("sdpa") before training'
        )


class SFTShardCallback(ShardStateCallback):
    """:class:`ShardStateCallback` for a :func:`trl_dataset` stream, checking the
    ``SFTConfig`` when the trainer is built and when training begins."""

    @property
    def seq_len(self) -> int:
        return max(m.seq_len for m in self.dataset.stream.order.manifests)

    def on_init_end(self, args, state, control, **kwargs):
        check_sft_config(args, self.seq_len)

    def on_train_begin(self, args, state, control, **kwargs):
        check_sft_config(args, self.seq_len)
        return super().on_train_begin(args, state, control, **kwargs)


def sft_callbacks(stream: Any, resume_from: str | None = None) -> list[SFTShardCallback]:
    """``SFTTrainer(callbacks=...)`` for a :func:`trl_dataset` stream."""
    return [SFTShardCallback(shard_dataset(stream), resume_from)]
