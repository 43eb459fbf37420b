"""Activation checkpoints offloaded to host memory (``model.offload_checkpoints``).

An :class:`Offload` (made by whoever installs offload:
:func:`ulysses_mm.model.memory.apply_memory_policy`, no module-level state) runs
the decoder layers with activation checkpointing whose kept input lives in host memory.
Each layer is one :class:`_OffloadedCheckpoint` (a reentrant checkpoint): its forward runs
without autograd and copies the layer's input to the host; its backward fetches the
input back, recomputes the layer with autograd and back-propagates through it, and starts
fetching the input of the layer before it (the next one backward reaches). That fetch
starts once the layer's attention backward (its high point) is done, when the layer marks
the point with :meth:`Offload.prefetch_after`; a layer that marks none starts it at once. The last
layer's input stays on the device: its backward comes first, right after the loss. On a
GPU the host buffers are pinned and both copies run on a side stream, overlapped with
compute; on CPU the same path runs with plain copies, and the host buffers are made
outside any dispatch mode, so :class:`ulysses_mm.tools.memory.TensorMemoryTracker` does
not count them as device tensors: :attr:`Offload.host` counts them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes


class HostCounter:
    """Bytes the offloaded checkpoints hold in host memory: live now and at most."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live


class HostCopy:
    """One layer input in host memory (counted in ``host``), and its way back to the
    device (``keep``: it stays on the device, nothing is copied)."""

    def __init__(
        self, x: Tensor, stream: Any, keep: bool = False, host: HostCounter | None = None
    ) -> None:
        self.device, self.stream = x.device, stream
        self.counter = host if host is not None else HostCounter()
        self.nbytes = x.numel() * x.element_size()
        self.fetched: Tensor | None = None
        self.event: Any = None
        self.previous: HostCopy | None = None  # the layer before: fetched next in backward
        if keep:
            self.host: Tensor | None = None
            self.fetched = x.detach()
            return
        # host memory, not a device tensor: made and filled outside any dispatch mode (a
        # memory tracker's included), counted in the host counter
        with _disable_current_modes():
            self.host = torch.empty(
                x.shape, dtype=x.dtype, device="cpu", pin_memory=stream is not None
            )
            if stream is None:
                self.host.copy_(x.detach())
            else:
                stream.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(stream):
                    self.host.copy_(x.detach(), non_blocking=True)
                x.record_stream(stream)  # x is not reused until the copy is done
        self.counter.add(self.nbytes)

    def prefetch(self) -> None:
        """Start the copy back to the device (no-op if started)."""
        if self.fetched is not None or self.host is None:
            return
        dev = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        if self.stream is None:
            dev.copy_(self.host)
        else:
            # dev's block may have been freed by work still queued on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dev.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(self.stream)
        self.fetched = dev

    def take(self) -> Tensor:
        """The input on the device (waiting for its copy); the host buffer is released."""
        self.prefetch()
        dev = self.fetched
        assert dev is not None
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            dev.record_stream(torch.cuda.current_stream(self.device))
        self.fetched, self.event = None, None
        self.release()
        return dev

    def release(self) -> None:
        if self.host is not None:
            self.host = None
            self.counter.add(-self.nbytes)


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        run: Callable[..., Tensor],
        offload: Offload,
        copy: HostCopy,
        x: Tensor,
        *args: Any,
    ) -> Tensor:
        ctx.run, ctx.offload, ctx.copy, ctx.args = run, offload, copy, args
        return run(x, *args)  # autograd is off in a Function's forward

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        copy: HostCopy = ctx.copy
        offload: Offload = ctx.offload
        x = copy.take()
        previous = copy.previous
        offload.pending = previous  # fetched once the layer's attention backward is done
        x = x.detach().requires_grad_(True)
        try:
            with torch.enable_grad():
                out = ctx.run(x, *ctx.args)
        finally:
            unmarked, offload.pending = offload.pending, None
        if unmarked is not None:
            unmarked.prefetch()  # no point marked: overlapped with the whole backward
        torch.autograd.backward(out, grad)
        if previous is not None:
            previous.prefetch()  # (no-op once started) a marked point that never ran
        nargs = len(ctx.args)
        ctx.run = ctx.args = ctx.copy = ctx.offload = None
        return (None, None, None, x.grad, *(None for _ in range(nargs)))


class Offload:
    """The offloaded checkpoints of one model: the bytes they hold in host memory
    (:attr:`host`) and the fetch a layer's backward starts once it is past its attention's
    backward (:attr:`pending`). Owned by whoever installs offload and passed in."""

    def __init__(self) -> None:
        self.host = HostCounter()
        self.pending: HostCopy | None = None

    def prefetch_after(self, t: Tensor) -> None:
        """Start the pending fetch of the previous layer's input once ``t``'s gradient is
        computed. A layer's query is marked: by then the attention's backward, the layer's
        high point, is done, so the fetched input is not alive at it. Outside an offloaded
        layer's recompute it does nothing."""
        copy = self.pending
        if copy is None or not (torch.is_grad_enabled() and t.requires_grad):
            return
        self.pending = None

        def start(grad: Tensor) -> None:
            copy.prefetch()

        t.register_hook(start)

    def run_layers(self, layers: Sequence[Callable[..., Tensor]], x: Tensor, *args: Any) -> Tensor:
        """``x`` through ``layers`` (each called as ``layer(x, *args)``), every layer
        checkpointed with its input kept in host memory. ``args`` get no gradient."""
        stream = None
        if x.is_cuda:
            stream = side_stream(x.device, "host copies")
        previous: HostCopy | None = None
        for i, layer in enumerate(layers):
            copy = HostCopy(x, stream, keep=i == len(layers) - 1, host=self.host)
            copy.previous = previous
            previous = copy
            x = _OffloadedCheckpoint.apply(layer, self, copy, x, *args)
        return x


_STREAMS: dict[tuple[str, torch.device], Any] = {}


def side_stream(device: torch.device, purpose: str) -> Any:
    """A CUDA stream beside the compute stream, made once per ``purpose`` and device:
    each purpose (host copies here, head groups' exchanges) has its own, so neither's work
    queues behind the other's."""
    key = (purpose, device)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]
