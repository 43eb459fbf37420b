from __future__ import annotations

import torch

from ulysses_mm.tools.memory import TensorMemoryTracker


def test_tracker_counts_live_storages_and_the_peak():
    keep = torch.zeros(250)  # exists before: counted only through track()
    with TensorMemoryTracker() as t:
        t.track([keep])
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(2000)  # 8000 bytes
        view = b[:10]  # a view allocates nothing
        del a
        c = torch.empty(500)  # 2000 bytes, after a was freed
    assert t.peak == 1000 + 4000 + 8000
    assert t.live == 1000 + 8000 + 2000
    del view, b, c


def test_tracker_sees_autograd_buffers():
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(512, 256)
    with TensorMemoryTracker() as t:
        t.track_module(lin)
        y = torch.relu(lin(x))
        y.sum().backward()
    weight = 256 * 256 * 4
    act = 512 * 256 * 4
    # weight + its gradient + the saved activations must all have been live together
    assert t.peak >= 2 * weight + act
    assert t.peak < 2 * weight + 6 * act
