"""The training loader: shards by URL through fsspec, read as a webdataset pipeline, in an
order that is a function of (seed, epoch, manifest), resumable at any sample.

Order. Epoch e visits every sample once: shards in a permutation drawn from
(seed, e), and inside each shard its samples in a permutation drawn from (seed, e, shard).
Position p of the epoch is thus a pure function, so the loader's whole state is
(epoch, position) and a resumed run continues exactly where it stopped, also in the middle
of a shard.

Split. Each optimizer micro-step consumes ``dp × micro_batch`` consecutive positions; DP
rank r takes positions ``[r·mb, (r+1)·mb)`` of them. Every SP rank of a DP group asks
for the same rank r and so gets the same samples (it then keeps its own slice). An epoch's
tail shorter than ``dp × micro_batch`` is dropped.

Reading. A shard is fetched whole through fsspec (bounded retries with exponential
backoff, then an error naming the URL), checked against the manifest's size and sha256,
and expanded by webdataset's tar iterators (``tar_file_expander`` + ``group_by_keys``);
only ``.npy`` members are decoded, with ``allow_pickle=False`` — a member of any other
kind is refused, so no path ever unpickles. The current shard's samples stay in memory
until the order moves on.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import webdataset as wds

from ulysses_mm.data.format import (
    SEGMENTS_KEY,
    TOKENS_KEY,
    PackedSample,
    ShardFormatError,
    load_npy,
)
from ulysses_mm.data.manifest import Manifest, read_verified_shard

STATE_VERSION = 1


def _decode_npy_only(sample: dict[str, Any], where: str) -> PackedSample:
    key = sample["__key__"]
    extra = sorted(
        k for k in sample if not k.startswith("__") and k not in (TOKENS_KEY, SEGMENTS_KEY)
    )
    if extra:
        raise ShardFormatError(
            f"{where}: sample {key} has members {extra}; only .npy arrays are read"
        )
    if TOKENS_KEY not in sample or SEGMENTS_KEY not in sample:
        raise ShardFormatError(f"{where}: sample {key} lacks {TOKENS_KEY} or {SEGMENTS_KEY}")
    tokens = load_npy(sample[TOKENS_KEY], f"{where}: {key}.{TOKENS_KEY}")
    segments = load_npy(sample[SEGMENTS_KEY], f"{where}: {key}.{SEGMENTS_KEY}")
    return PackedSample(int(key), tokens, segments)


def shard_samples(data: bytes, where: str) -> list[PackedSample]:
    """Decode one shard's bytes with a webdataset pipeline (tar members -> samples)."""
    pipeline = wds.DataPipeline(
        lambda: iter([{"url": where, "stream": io.BytesIO(data)}]),
        wds.tariterators.tar_file_expander,
        wds.tariterators.group_by_keys,
        wds.map(lambda s: _decode_npy_only(s, where)),
    )
    return list(pipeline)


class ShardStream:
    """Micro-batches of packed samples for one DP rank (see the module docstring)."""

    def __init__(
        self,
        manifest: Manifest,
        dp_rank: int,
        dp: int,
        micro_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        retries: int = 5,
        backoff_s: float = 0.5,
    ) -> None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} is outside dp={dp}")
        self.manifest = manifest
        self.dp_rank, self.dp, self.micro_batch = dp_rank, dp, micro_batch
        self.seed, self.shuffle = seed, shuffle
        self.retries, self.backoff_s = max(1, retries), backoff_s
        self.global_batch = dp * micro_batch
        if manifest.num_samples < self.global_batch:
            raise ValueError(
                f"{manifest.location} holds {manifest.num_samples} samples, fewer than one global "
                f"micro-batch (dp {dp} × micro_batch {micro_batch})"
            )
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.empty(0, dtype=np.int64)
        self._cache: dict[int, list[PackedSample]] = {}

    # ----------------------------------------------------------------- order
    @property
    def batches_per_epoch(self) -> int:
        return self.manifest.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global sample indices in the order epoch ``epoch`` visits them."""
        shards = self.manifest.shards
        if not self.shuffle:
            return np.arange(self.manifest.num_samples, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        for s in rng.permutation(len(shards)):
            inner = np.random.default_rng([self.seed, epoch, int(s)]).permutation(shards[s].samples)
            parts.append(shards[s].first_sample + inner)
        return np.concatenate(parts).astype(np.int64)

    def _positions(self) -> list[int]:
        if self.position + self.global_batch > self.manifest.num_samples:
            self.epoch += 1
            self.position = 0
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        start = self.position + self.dp_rank * self.micro_batch
        return [int(i) for i in self._order[start : start + self.micro_batch]]

    # --------------------------------------------------------------- reading
    def _read_shard(self, shard: int) -> list[PackedSample]:
        location = self.manifest.shard_location(shard)
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                data = read_verified_shard(self.manifest, shard)
            # transport faults arrive as many types (OSError, aiohttp, botocore, a short
            # read caught as a checksum mismatch): all are retried, boundedly
            except Exception as e:
                if attempt == self.retries:
                    raise OSError(
                        f"could not read shard {location} after {self.retries} attempts: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                time.sleep(delay)
                delay *= 2
            else:
                return shard_samples(data, location)  # a malformed shard is not retried
        raise AssertionError("unreachable")

    def _sample(self, index: int) -> PackedSample:
        shard, offset = self.manifest.shard_of_sample(index)
        if shard not in self._cache:
            if len(self._cache) >= 2:  # keep the current and the previous shard only
                self._cache.pop(next(iter(self._cache)))
            samples = self._read_shard(shard)
            if len(samples) != self.manifest.shards[shard].samples:
                raise ShardFormatError(
                    f"{self.manifest.shard_location(shard)}: holds {len(samples)} samples, the "
                    f"manifest says {self.manifest.shards[shard].samples}"
                )
            self._cache[shard] = samples
        sample = self._cache[shard][offset]
        if sample.index != index:
            raise ShardFormatError(
                f"{self.manifest.shard_location(shard)}: sample {offset} has key {sample.index}, expected {index}"
            )
        return sample

    def next_batch(self) -> list[PackedSample]:
        """This DP rank's ``micro_batch`` samples of the next global micro-batch."""
        samples = [self._sample(i) for i in self._positions()]
        self.position += self.global_batch
        return samples

    def __iter__(self) -> Iterator[list[PackedSample]]:
        while True:
            yield self.next_batch()

    # ----------------------------------------------------------------- state
    def _identity(self) -> list[str]:
        return [s.sha256 for s in self.manifest.shards]

    def state_dict(self) -> dict[str, Any]:
        """Identical on every rank: where the global order stands."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch": self.global_batch,
            "shards": self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        if state["shards"] != self._identity():
            raise ValueError(
                f"the checkpoint's loader state belongs to other shards than {self.manifest.location}"
            )
        for key in ("seed", "shuffle", "global_batch"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"resuming with {key}={getattr(self, key)} but the checkpoint was made with {state[key]}"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
