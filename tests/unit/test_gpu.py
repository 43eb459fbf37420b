"""GPU kernels against the CPU-proven reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import available_kernels, build_model
from ulysses_mm.model.attention import DocumentMask, LocalAttention, resolve_kernel
from ulysses_mm.model.llama import RotaryEmbedding

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


def _step(device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One fp32 step of a small model on ``device``: (loss, every parameter's grad), on the
    CPU. Same seed, same batch on both devices."""
    model = build_model(ModelConfig(modalities={"dna": 10, "audio": 256}), seed=0).to(device)
    batch = random_batch(model.space, 2, 1024, seed=0).to(device)
    sums, counts, *_ = model(
        batch.input_ids, batch.position_ids, batch.doc_ids, batch.labels, batch.label_modality
    )
    loss = sums.sum() / counts.sum()
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_model_step_on_gpu_matches_the_cpu_step():
    """The same step on the GPU and the CPU: loss and every gradient (fp32; the kernels
    differ, so summation order does)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    gpu_loss, gpu_grads = _step("cuda")
    cpu_loss, cpu_grads = _step("cpu")
    assert_close(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys()
    for name, g in gpu_grads.items():
        assert_close(g, cpu_grads[name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_runs_fp32_gqa_on_gpu_without_flash_attn_and_matches_cpu():
    """fp32 on CUDA: auto must not pick flash-attn, and SDPA runs GQA by expanding k, v."""
    assert resolve_kernel("auto", "cuda", torch.float32) == "sdpa_varlen"
    q, k, v, mask = _qkv(torch.float32)
    got = LocalAttention("auto")(q, k, v, mask)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    want = LocalAttention("sdpa_varlen")(*cpu, DocumentMask(mask.doc_ids.cpu()))
    assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    got.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip((q, k, v), cpu):
        assert_close(a.grad.cpu(), b.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("s", [600, 2048])
def test_flex_block_mask_from_spans_on_gpu(s):
    q, k, v, mask = _qkv(torch.bfloat16, s=s)
    want = LocalAttention("sdpa_varlen")(q, k, v, mask)
    got = LocalAttention("flex")(q, k, v, mask)
    assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_rope_on_gpu_at_2_25_matches_fp64():
    rope = RotaryEmbedding(128, 500000.0).cuda().bfloat16()
    pos = torch.arange(1 << 25, (1 << 25) + 16, device="cuda").reshape(1, -1)
    cos, _ = rope(pos, torch.float32)
    assert rope.inv_freq.dtype == torch.float32
    angles = pos.double()[..., None] * rope.inv_freq.double()
    assert_close(cos.double(), torch.cat((angles, angles), -1).cos(), rtol=0, atol=2e-6)


def test_flash_varlen_over_65535_documents():
    if "flash_varlen" not in available_kernels(device="cuda"):
        pytest.skip("flash-attn not available")
    s = 70_000
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = torch.randn(3, 1, s, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    doc = torch.arange(s, device="cuda").reshape(1, s)  # one-token documents
    out = LocalAttention("flash_varlen")(q, k, v, DocumentMask(doc))
    assert_close(out, v)  # a one-token document attends to itself only


@pytest.mark.parametrize("chunks", [2, 4])
def test_head_groups_on_the_gpu_match_all_heads(chunks):
    """Attention in head groups on CUDA (the forward's exchanges on a side stream, here
    without SP) gives the all-heads output and gradients."""
    from ulysses_mm.parallel import UlyssesAttention

    q, k, v, mask = _qkv(torch.bfloat16)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kernel = "auto"
    want = LocalAttention(kernel)(*ref_in, mask)
    got = UlyssesAttention(LocalAttention(kernel), None, 8, 2, head_groups=chunks)(q, k, v, mask)
    assert_close(got, want, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    for a, b in zip((q, k, v), ref_in):
        assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)
