"""GPU kernels against the CPU-proven reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig
from ulysses_mm.data.synthetic import random_batch
from ulysses_mm.model import available_kernels, build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention

pytestmark = pytest.mark.gpu


def _qkv(dtype, hq=8, hk=2, s=512, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, s, hq, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(2, s, hk, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(2, s, hk, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    doc = torch.cumsum(torch.rand(2, s, device="cuda", generator=g) < 0.01, dim=1)
    return q, k, v, DocumentMask(doc)


@pytest.mark.parametrize(
    "kernel",
    [k for k in ("flash_varlen", "flex") if k in available_kernels(device="cuda")] or ["flex"],
)
def test_gpu_kernels_match_sdpa_varlen(kernel):
    if kernel not in available_kernels(device="cuda"):
        pytest.skip(f"{kernel} not available")
    q, k, v, mask = _qkv(torch.bfloat16)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = LocalAttention("sdpa_varlen")(*ref_in, mask)
    got = LocalAttention(kernel)(q, k, v, mask)
    assert_close(got, want, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    for a, b in zip((q, k, v), ref_in):
        assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-2)


def test_model_trains_a_step_on_gpu():
    model = build_model(ModelConfig(modalities={"dna": 10, "audio": 256}), seed=0).cuda()
    batch = random_batch(model.space, 2, 1024, seed=0).to("cuda")
    sums, counts = model(
        batch.input_ids, batch.position_ids, batch.doc_ids, batch.labels, batch.label_modality
    )
    (sums.sum() / counts.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
