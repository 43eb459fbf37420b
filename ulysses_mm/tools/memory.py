"""Peak tensor memory of a block of code, on CPU as on GPU.

On CUDA the caching allocator keeps the figure (``torch.cuda.max_memory_allocated``). On
CPU there is no such counter, so :class:`TensorMemoryTracker` counts it: a dispatch mode
sees every tensor an operator returns, adds its storage's bytes the first time it sees the
storage, and a weak reference subtracts them when the storage is freed. Storages that
exist before the block (parameters, gradients, optimizer state) are counted with
:meth:`TensorMemoryTracker.track`. Library-internal buffers (gloo's, oneDNN scratch) are not
tensors and are not counted; the figure is what the model's tensors occupy, the same
quantity the CUDA counter reports.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as t: ...`` then ``t.peak`` (bytes, live at most)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes or storage.device.type == "meta":
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def _freed(self, key: int, _ref: Any) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count storages that already exist (parameters, gradients, ...)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())

    def track_module(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        self.track(module.parameters())
        self.track(p.grad for p in module.parameters())
        self.track(module.buffers())
        if optimizer is not None:
            for state in optimizer.state.values():
                self.track(v for v in state.values() if isinstance(v, torch.Tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._add(t.untyped_storage())
        return out
