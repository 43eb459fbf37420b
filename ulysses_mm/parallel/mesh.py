"""The process layout: one explicit value with named axes ``dp`` and ``sp``, and the
:class:`Place` (this process's mesh, device and backend) that :func:`open_world` returns
once it has joined the world.

world = dp × sp with sp innermost: global rank = dp_rank · sp + sp_rank, so the ranks of an
SP group are consecutive (on GPUs they share a node and the all-to-all stays on NVLink).
No module-level process-group state: the :class:`Mesh` is built once and passed in.

Hybrid Ulysses × ring (``ring_size`` = R > 1): each SP group of sp = U × R ranks splits
into R Ulysses groups of U = ``ulysses_size`` consecutive ranks (sp_rank = ring_rank · U +
ulysses_rank) and U rings of R ranks at stride U. At R = 1 the Ulysses group is the SP
group and there is no ring.

Names: ``sp`` is always the whole SP group's size U × R; a size is ``*_size`` (or the bare
axis name ``dp``/``sp``), a position in a group ``*_rank``, the global ranks of a group's
members ``*_members``.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ulysses_mm.core.errors import ConfigError, UnsupportedError
from ulysses_mm.core.launch_env import LAUNCH_ENV, in_launched_world
from ulysses_mm.core.layout import Layout, LayoutError

if TYPE_CHECKING:
    from ulysses_mm.config import RunConfig


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a :class:`~ulysses_mm.core.layout.Layout` and the process
    groups of its axes."""

    layout: Layout
    rank: int
    sp_group: Any = None  # ProcessGroup of this rank's SP group (None when sp == 1 alone)
    dp_group: Any = None  # ProcessGroup of ranks holding the same SP slice
    world_group: Any = None  # the default group (None for a single process)
    ulysses_group: Any = None  # U consecutive ranks (the SP group itself when R == 1)
    ring_group: Any = None  # R ranks at stride U (None when R == 1)
    ring_members: tuple[int, ...] = ()  # global ranks of this rank's ring, in ring order

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def ring_size(self) -> int:
        """R: ring size inside the SP group (sp = U × R)."""
        return self.layout.ring_size

    @property
    def ulysses_size(self) -> int:
        """U: the ranks of one Ulysses all-to-all group (sp / ring_size)."""
        return self.layout.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

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
        return cls(Layout(), rank=0)

    @classmethod
    def build(cls, sp: int, dp: int = 0, ring_size: int = 1, head_groups: int = 1) -> Mesh:
        """:meth:`over` the layout of ``sp`` × ``dp`` (0: world / sp; ``ring_size`` = R
        divides sp) on the initialised default process group's world.

        Every rank must call this (group creation is collective)."""
        if not dist.is_initialized():
            if sp == 1 and dp in (0, 1) and ring_size == 1:
                return cls(Layout(head_groups=head_groups), rank=0)
            raise RuntimeError(
                "torch.distributed is not initialised; call init_distributed() first"
            )
        return cls.over(Layout.resolve(dist.get_world_size(), sp, dp, ring_size, head_groups))

    @classmethod
    def over(cls, layout: Layout) -> Mesh:
        """The mesh of ``layout`` over the initialised default process group, whose world
        it must fill (one process without a group: the single mesh).

        Every rank must call this (group creation is collective)."""
        if not dist.is_initialized():
            if layout.world_size == 1:
                return cls(layout, rank=0)
            raise RuntimeError(
                "torch.distributed is not initialised; call init_distributed() first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if layout.world_size != world:
            raise LayoutError(
                f"dp={layout.dp} × sp={layout.sp} = {layout.world_size} but the world has "
                f"{world} processes"
            )
        dp, sp, ring_size = layout.dp, layout.sp, layout.ring_size
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
        ulysses_group, ring_group = sp_group, None
        ring_members: tuple[int, ...] = ()
        if ring_size > 1:
            u = layout.ulysses_size
            ulysses_group = None
            for d in range(dp):
                for j in range(ring_size):
                    ranks = [d * sp + j * u + i for i in range(u)]
                    g = dist.new_group(ranks) if u > 1 else None
                    if rank in ranks:
                        ulysses_group = g
                for i in range(u):
                    ranks = [d * sp + j * u + i for j in range(ring_size)]
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        ring_group, ring_members = g, tuple(ranks)
        return cls(
            layout,
            rank=rank,
            sp_group=sp_group,
            dp_group=dp_group,
            world_group=dist.group.WORLD,
            ulysses_group=ulysses_group,
            ring_group=ring_group,
            ring_members=ring_members,
        )

    def describe(self) -> str:
        text = f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp} × sp {self.sp_rank}/{self.sp}"
        if self.ring_size > 1:
            u, r = f"{self.ulysses_rank}/{self.ulysses_size}", f"{self.ring_rank}/{self.ring_size}"
            text += f" (ulysses {u} × ring {r})"
        return text


def choose_backend(requested: str, device: str, cuda_devices: int, local_world_size: int) -> str:
    """The torch.distributed backend for ``requested`` ("auto", "gloo", "nccl") when
    ``device`` ("auto", "cuda", "cpu") is asked for, ``cuda_devices`` GPUs are visible and
    ``local_world_size`` processes run on this machine.

    NCCL needs a GPU of its own for every local rank (rank r uses cuda:r): ``auto`` picks it
    only then, and never for ``device="cpu"``; anything else is gloo. An explicit choice
    that cannot run is refused here, in one line, instead of failing in set_device."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"unknown backend {requested!r}; choose auto, gloo or nccl")
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"unknown device {device!r}; choose auto, cuda or cpu")
    enough = cuda_devices >= max(1, local_world_size)
    if device == "cuda" and not enough:
        raise ConfigError(
            f"{local_world_size} local processes need {local_world_size} GPUs; "
            f"{cuda_devices} visible"
        )
    if requested == "nccl" and (device == "cpu" or not enough):
        raise ConfigError(
            f"backend nccl needs a GPU per local process ({local_world_size} processes, "
            f"{cuda_devices} GPUs{', device cpu' if device == 'cpu' else ''}); use gloo or auto"
        )
    if requested != "auto":
        return requested
    return "nccl" if device != "cpu" and enough else "gloo"


def default_backend(backend: str = "auto", device: str = "auto") -> str:
    """:func:`choose_backend` for this machine and the launched world's local size
    (LOCAL_WORLD_SIZE from torchrun, LOCAL_SIZE from the DeepSpeed launcher; at least
    LOCAL_RANK + 1)."""
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1)
    local = max(local, int(env.get("LOCAL_RANK", "0")) + 1)
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    return choose_backend(backend, device, gpus, local)


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> tuple[int, int]:
    """Join the world that torchrun / the DeepSpeed launcher / our spawner describes in the
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Returns (rank, world).

    With NCCL the default group is bound to this rank's GPU (``device_id``): it is created
    eagerly and the groups made later are split from it, so they can share its resources."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in LAUNCH_ENV if k not in os.environ]
    if missing:
        raise UnsupportedError(
            f"not inside a launched world ({', '.join(missing)} unset): start with torchrun, the "
            "DeepSpeed launcher or --nproc"
        )
    backend = default_backend(backend)
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend=backend, timeout=timedelta(seconds=timeout_s), device_id=device_id
    )
    return dist.get_rank(), dist.get_world_size()


def close_world() -> None:
    """End this process's part in the world once its work is done (``destroy_process_group``,
    as torch asks of every trainer before it exits): a gloo group left to the interpreter's
    shutdown may abort the process (``terminate called without an active exception``) after
    a run that succeeded. Only on success: a failed rank leaves without waiting on peers."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Place:
    """This process's place in the run: the mesh, its device and the backend."""

    mesh: Mesh
    device: torch.device
    backend: str  # the torch.distributed backend ("none" for a lone process)


def _single_process_env() -> None:
    """DeepSpeed needs a process group even for one process; describe a one-rank world on
    a free loopback port (it would otherwise go looking for MPI)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _group_env() -> None:
    """A process group made by hand (tests' spawner) describes itself to DeepSpeed, which
    reads RANK, LOCAL_RANK and WORLD_SIZE, as a launcher would have set them."""
    rank = str(dist.get_rank())
    os.environ.setdefault("RANK", rank)
    os.environ.setdefault("LOCAL_RANK", rank)
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))


# Where DeepSpeed's log goes, set by the ``train`` / ``demo`` commands (the ranks inherit
# it): "run" (the run's logs/deepspeed-rank-N.log) or "run+terminal" (``-v``: there and on
# the terminal). Unset (a library caller, a test, a benchmark): DeepSpeed's own handler.
DEEPSPEED_LOG_ENV = "ULYSSES_MM_DEEPSPEED_LOG"


class _RankLogFile(logging.FileHandler):
    """A file handler that makes its directory and file only when something is logged."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True)

    def emit(self, record: logging.LogRecord) -> None:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        super().emit(record)


def import_deepspeed(backend: str) -> Any:
    """Import DeepSpeed for a run over ``backend`` (every route: ours, the HF examples).

    Off NCCL the accelerator is named (``DS_ACCELERATOR=cpu``, unless the user set one):
    the device is the CPU then, and DeepSpeed would otherwise warn on every rank that it
    fell back to it. On gloo its shared-memory communication op is marked not wanted:
    DeepSpeed compiles it (a minute of C++ on a first run) when its CPU backend starts, for
    ``inference_all_reduce`` (tensor-parallel inference), which training never calls; its
    own gloo ``all_reduce`` is what runs. That op table is DeepSpeed's cached compatibility
    probe (``deepspeed.ops.__compatible_ops__``), kept in its module to be edited so."""
    if backend != "nccl":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # lazy: DeepSpeed reads DS_ACCELERATOR when it is imported
    import deepspeed.ops  # lazy: as deepspeed

    if backend == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _quiet_deepspeed(backend: str, log_dir: Path) -> Any:
    """:func:`import_deepspeed` with its output where it belongs: in a ``train`` or
    ``demo`` run its logger goes to ``log_dir/deepspeed-rank-N.log`` (and to the terminal
    too under ``-v``), not between our progress lines (see ``DEEPSPEED_LOG_ENV``)."""
    deepspeed = import_deepspeed(backend)
    from deepspeed.utils import logger  # lazy: as deepspeed

    mode = os.environ.get(DEEPSPEED_LOG_ENV, "")
    if not mode:
        return deepspeed
    rank = os.environ.get("RANK", "0")
    for h in list(logger.handlers):  # its stdout handler; ours from an earlier open_world
        if isinstance(h, _RankLogFile) or "terminal" not in mode:
            logger.removeHandler(h)
            h.close()
    to_file = _RankLogFile(log_dir / f"deepspeed-rank-{rank}.log")
    to_file.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(to_file)
    logger.setLevel(logging.INFO)  # the terminal handler (-v) keeps its own WARNING level
    return deepspeed


def open_world(cfg: RunConfig, deepspeed_comm: bool = True, device: str | None = None) -> Place:
    """Join the launched world (or the process group already made), build the mesh of
    ``parallel.sp`` × ``parallel.dp`` and pick the device: this rank's GPU under NCCL,
    else the CPU (``device`` overrides). ``deepspeed_comm``: also initialise DeepSpeed's
    communication (a lone process then gets a one-rank group, which DeepSpeed needs)."""
    backend = default_backend(cfg.parallel.backend)
    if dist.is_initialized():
        backend = str(dist.get_backend())
        _group_env()
    elif in_launched_world():
        init_distributed(backend, cfg.parallel.timeout_s)
    elif deepspeed_comm:
        _single_process_env()
        init_distributed(backend, cfg.parallel.timeout_s)
    if deepspeed_comm:
        deepspeed = _quiet_deepspeed(backend, Path(cfg.train.out_dir) / "logs")
        deepspeed.init_distributed(backend, verbose=False)
    p = cfg.parallel
    world = dist.get_world_size() if dist.is_initialized() else p.sp * (p.dp or 1)
    mesh = Mesh.over(Layout.from_config(p, world))
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}" if backend == "nccl" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return Place(mesh, dev, backend if dist.is_initialized() else "none")
