"""Checkpoint files written off the step loop: the state copied into one host buffer, then
serialized by a writer process (or a thread).

``torch.save`` and safetensors' serialization hold the GIL while they checksum and
write, so a writer *thread* takes it from the training thread for as long as a write lasts
(measured in ``benchmarks/bench_async_save.py``: the step after a save ran 4.3 × slower
beside one). A writer *process* does not: :func:`pack` copies every tensor of a state
dict into one buffer in shared memory (one allocation, one file descriptor to pass), the
process receives the structure through a ``torch.multiprocessing`` queue (the tensors
arrive as views of that buffer, not as copies) and writes the files. This is PyTorch
DCP's process-based async save and DeepSpeed's decoupled engine, without their extra
dependencies. ``train.save_writer`` chooses: the thread is the default (on the 2-core
CPU machine it cost the steps less than the process did: there the cores, not the GIL,
are what the writer and training share), the process where the GIL is what they share.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from ulysses_mm.core.errors import first_line
from ulysses_mm.core.storage import atomic_local_file, atomic_write_local
from ulysses_mm.parallel.launch import die_with_parent

_ALIGN = 64
_SHM = Path("/dev/shm")
WRITER_NICE = 10  # the writer's scheduling priority below training's


def nbytes(obj: Any) -> int:
    """The bytes :func:`pack` needs for ``obj``'s tensors."""
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return t

    map_tensors(obj, add)
    return total


def shm_fits(size: int) -> bool:
    """Whether ``/dev/shm`` has room for ``size`` bytes twice over."""
    try:
        return shutil.disk_usage(_SHM).free >= 2 * size
    except OSError:
        return False


def pack(obj: Any, shared: bool = False, pin: bool = False) -> Any:
    """``obj`` with every tensor copied into one new host buffer (in shared memory with
    ``shared``, pinned with ``pin``; containers rebuilt), so later changes to the live
    state do not reach the copy."""
    size = nbytes(obj)
    if shared:
        storage = torch.UntypedStorage._new_shared(max(size, 1))
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pin)
    at = [0]

    def copy(t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        view = buffer[at[0] : at[0] + n].view(t.dtype).view(t.shape)
        at[0] += -(-n // _ALIGN) * _ALIGN
        return view.copy_(t.detach(), non_blocking=pin)

    out = map_tensors(obj, copy)
    if pin:
        torch.cuda.synchronize()  # the copies landed before the step changes the state
    return out


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (dicts, lists and plain tuples
    rebuilt; anything else kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def unshare(obj: Any) -> Any:
    """``obj`` with each tensor in a storage of its own (views of one buffer would be
    saved, and loaded, as that whole buffer)."""
    return map_tensors(obj, torch.Tensor.clone)


def write(
    fmt: str, obj: Any, path: Path, metadata: dict[str, str] | None = None, packed: bool = True
) -> None:
    """Write ``obj`` in format ``fmt`` (``torch`` or ``safetensors``) to ``path`` through a
    temporary sibling and a rename: a file is whole or absent. ``packed``: its tensors
    are views of one :func:`pack` buffer (each gets a storage of its own first)."""
    if packed:
        obj = unshare(obj)
    if fmt == "torch":
        with atomic_local_file(path) as f:
            torch.save(obj, f)
    elif fmt == "safetensors":
        from safetensors.torch import save as save_safetensors  # lazy: only this format needs it

        atomic_write_local(path, save_safetensors(obj, metadata=metadata))
    else:
        raise ValueError(f"no writer for {fmt!r}")


def _serve(jobs: Any, acks: Any) -> None:
    """The writer process: write each job, acknowledge it (None, or the error's line)."""
    die_with_parent()
    torch.set_num_threads(1)
    # below training on shared cores: the steps keep their pace, the write takes longer
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICE)
    # the zip records' CRC32 is most of torch.save's CPU time; files are still whole or
    # absent (written to a temporary name, then renamed) and torch.load does not need it
    with contextlib.suppress(Exception):  # the switch is newer than some torch releases
        from torch.utils.serialization import config  # lazy: newer torch only, hence the suppress

        config.save.compute_crc32 = False
    while (job := jobs.get()) is not None:
        fmt, obj, path, metadata = job
        try:
            write(fmt, obj, Path(path), metadata)
        except Exception as e:
            acks.put(first_line(e))
        else:
            acks.put(None)
        del obj, job


class WriterProcess:
    """One process that writes files from :func:`pack`-ed (shared) state, one at a time."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = ctx.SimpleQueue()  # put pickles here and now: an error reaches the caller
        self.acks = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(self.jobs, self.acks), daemon=True)
        self.proc.start()

    def write(self, fmt: str, obj: Any, path: Path, metadata: dict[str, str] | None = None):
        """Hand one file to the process and wait for it (this blocks a writer thread, not
        the step loop); its failure, or its death, is a ``RuntimeError``."""
        self.jobs.put((fmt, obj, str(path), metadata))
        while True:
            try:
                error = self.acks.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"the checkpoint writer process died (exit code {self.proc.exitcode})"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(error)
            return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.jobs.put(None)
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.jobs.close()
            self.acks.close()
            self.acks.join_thread()
