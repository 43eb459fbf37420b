"""The process layout: one explicit value with named axes ``dp`` and ``sp``.

world = dp × sp with sp innermost: global rank = dp_rank · sp + sp_rank, so the ranks of an
SP group are consecutive (on GPUs they share a node and the all-to-all stays on NVLink).
No module-level process-group state: the :class:`Mesh` is built once and passed in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ulysses_mm.layout import check_layout


@dataclass(frozen=True)
class Mesh:
    dp: int
    sp: int
    rank: int
    sp_group: Any = None  # ProcessGroup of this rank's SP group (None when sp == 1 alone)
    dp_group: Any = None  # ProcessGroup of ranks holding the same SP slice
    world_group: Any = None  # the default group (None for a single process)

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls) -> Mesh:
        """One process, no collectives: the reference every parallel layout must match."""
        return cls(dp=1, sp=1, rank=0)

    @classmethod
    def build(cls, sp: int, dp: int = 0) -> Mesh:
        """The mesh over the initialised default process group (dp = 0: world / sp).

        Every rank must call this (group creation is collective)."""
        if not dist.is_initialized():
            if sp == 1 and dp in (0, 1):
                return cls.single()
            raise RuntimeError(
                "torch.distributed is not initialised; call init_distributed() first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = check_layout(sp, dp=dp, world=world)
        sp_group = dp_group = None
        for d in range(dp):
            ranks = list(range(d * sp, (d + 1) * sp))
            g = dist.new_group(ranks)
            if rank in ranks:
                sp_group = g
        for s in range(sp):
            ranks = list(range(s, world, sp))
            g = dist.new_group(ranks)
            if rank in ranks:
                dp_group = g
        return cls(
            dp=dp,
            sp=sp,
            rank=rank,
            sp_group=sp_group,
            dp_group=dp_group,
            world_group=dist.group.WORLD,
        )

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp} × sp {self.sp_rank}/{self.sp}"


def default_backend(backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> tuple[int, int]:
    """Join the world that torchrun / the DeepSpeed launcher / our spawner describes in the
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Returns (rank, world)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"not inside a launched world ({', '.join(missing)} unset): start with torchrun, the "
            "DeepSpeed launcher or --nproc"
        )
    backend = default_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def in_launched_world() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
