"""The paths a first GPU run takes, proven on CPU: which kernel and which backend run (pure
functions of the machine), flash-attn loading and its document limit, SDPA's GQA on CUDA,
RoPE at chromosome-length positions, flex's block mask and the estimate's GPU terms."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig, RunConfig, load_config
from ulysses_mm.model import attention, build_model
from ulysses_mm.model.attention import (
    DocumentMask,
    check_kernel_config,
    choose_kernel,
    sdpa_native_gqa,
)
from ulysses_mm.model.llama import RotaryEmbedding
from ulysses_mm.parallel import mesh as mesh_mod
from ulysses_mm.parallel.mesh import choose_backend
from ulysses_mm.tools.estimate import (
    CONTEXT_RESERVE_GIB,
    NCCL_GIB_PER_COMMUNICATOR,
    EstimateOptions,
    GiB,
    estimate,
    flex_block_mask_bytes,
)
from ulysses_mm.tools.memory import TensorMemoryTracker

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# --------------------------------------------------------------------------- kernel choice


@pytest.mark.parametrize(
    ("device", "dtype", "flash", "want"),
    [
        ("cuda", torch.bfloat16, True, "flash_varlen"),
        ("cuda", torch.float16, True, "flash_varlen"),
        ("cuda", "bf16", True, "flash_varlen"),
        ("cuda", torch.float32, True, "sdpa_varlen"),  # flash-attn has no fp32 kernel
        ("cuda", "fp32", True, "sdpa_varlen"),
        ("cuda", torch.bfloat16, False, "sdpa_varlen"),
        ("cpu", torch.bfloat16, True, "sdpa_varlen"),
        ("cpu", torch.float32, False, "sdpa_varlen"),
    ],
)
def test_auto_picks_a_kernel_the_dtype_allows(device, dtype, flash, want):
    assert choose_kernel("auto", device, dtype, flash) == want


def test_flash_in_fp32_is_a_config_error_in_one_line():
    with pytest.raises(ValueError, match="needs deepspeed.precision bf16 or fp16") as e:
        check_kernel_config("flash_varlen", "fp32")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="flash-attn has no float32 kernel"):
        choose_kernel("flash_varlen", "cuda", torch.float32, flash=True)
    for precision in ("bf16", "fp16"):
        check_kernel_config("flash_varlen", precision)  # fine wherever flash-attn loads
    for kernel in ("auto", "sdpa_varlen", "sdpa_dense", "flex"):
        check_kernel_config(kernel, "fp32")
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        check_kernel_config("nope", "bf16")
    # explicit flash where it cannot load: a RuntimeError naming the fix
    with pytest.raises(RuntimeError, match="needs flash-attn and a CUDA GPU"):
        choose_kernel("flash_varlen", "cuda", torch.bfloat16, flash=False)
    with pytest.raises(RuntimeError, match="needs flash-attn and a CUDA GPU"):
        choose_kernel("flash_varlen", "cpu", torch.bfloat16, flash=True)


def test_estimate_counts_the_kernel_the_precision_runs():
    cfg = load_config(RunConfig, CONFIGS / "small.yaml")  # fp32
    assert cfg.deepspeed.precision == "fp32"
    assert estimate(cfg, 4096).kernel == "sdpa_varlen"
    bf16 = load_config(RunConfig, CONFIGS / "small.yaml", ["deepspeed.precision=bf16"])
    assert estimate(bf16, 4096).kernel == "flash_varlen"
    assert estimate(bf16, 4096, EstimateOptions(device="cpu")).kernel == "sdpa_varlen"


# --------------------------------------------------------------------------- backend choice


@pytest.mark.parametrize(
    ("requested", "device", "gpus", "local", "want"),
    [
        ("auto", "auto", 8, 8, "nccl"),
        ("auto", "auto", 8, 2, "nccl"),
        ("auto", "auto", 1, 2, "gloo"),  # two processes on one GPU: set_device(1) would fail
        ("auto", "auto", 0, 1, "gloo"),
        ("auto", "cpu", 8, 2, "gloo"),  # --device cpu: gloo even where GPUs are
        ("auto", "cuda", 2, 2, "nccl"),
        ("gloo", "auto", 8, 8, "gloo"),
        ("nccl", "auto", 4, 4, "nccl"),
        ("gloo", "cpu", 0, 4, "gloo"),
    ],
)
def test_backend_is_nccl_only_when_every_local_rank_has_a_gpu(requested, device, gpus, local, want):
    assert choose_backend(requested, device, gpus, local) == want


def test_impossible_backend_requests_are_refused():
    with pytest.raises(ValueError, match="nccl needs a GPU per local process"):
        choose_backend("nccl", "auto", 1, 2)
    with pytest.raises(ValueError, match="nccl needs a GPU per local process"):
        choose_backend("nccl", "cpu", 8, 1)
    with pytest.raises(ValueError, match="2 local processes need 2 GPUs; 1 visible"):
        choose_backend("auto", "cuda", 1, 2)
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("mpi", "auto", 0, 1)


def test_default_backend_reads_the_local_world_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert mesh_mod.default_backend() == "nccl"
    assert mesh_mod.default_backend(device="cpu") == "gloo"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert mesh_mod.default_backend() == "gloo"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_RANK", "1")  # a second local rank whatever the launcher says
    assert mesh_mod.default_backend() == "gloo"


def test_nccl_binds_the_default_group_to_the_rank_gpu(monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set", d))
    monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh_mod.dist, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(mesh_mod.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(mesh_mod.dist, "get_world_size", lambda: 2)
    env = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="1", LOCAL_RANK="1")
    for k, v in {**env, "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert mesh_mod.init_distributed() == (1, 2)
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 1)
    assert calls["set"] == torch.device("cuda", 1)
    calls.clear()
    assert mesh_mod.init_distributed("gloo") == (1, 2)
    assert calls["backend"] == "gloo" and calls["device_id"] is None and "set" not in calls


# --------------------------------------------------------------------------- flash-attn


def test_a_flash_wheel_that_does_not_load_falls_back_with_one_warning(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            raise ImportError(
                "flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"
            )
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    attention._flash_varlen_func.cache_clear()
    try:
        with pytest.warns(RuntimeWarning) as caught:
            assert attention._flash_varlen_func() is None
            assert attention._flash_varlen_func() is None  # cached: imported once
        assert len(caught) == 1
        msg = str(caught[0].message)
        assert "\n" not in msg and "undefined symbol" in msg and "sdpa_varlen" in msg
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            assert not attention.flash_attn_available()
            assert attention.resolve_kernel("auto", "cuda", torch.bfloat16) == "sdpa_varlen"
    finally:
        attention._flash_varlen_func.cache_clear()


def _fake_flash(calls: list):
    """flash_attn_varlen_func's contract, by SDPA per document; records each call."""

    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        assert causal and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        n_docs = len(cu_seqlens_q) - 1
        assert n_docs <= 65_535, "grid limit exceeded"
        assert int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == q.shape[0]
        lengths = torch.diff(cu_seqlens_q).tolist()
        assert max_seqlen_q == max(lengths)
        calls.append(n_docs)
        outs = []
        for qd, kd, vd in zip(*(t.split(lengths) for t in (q, k, v))):
            # [L, h, d] -> [h, L, d]
            o = F.scaled_dot_product_attention(
                qd.transpose(0, 1),
                kd.transpose(0, 1),
                vd.transpose(0, 1),
                is_causal=True,
                enable_gqa=qd.shape[1] != kd.shape[1],
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    return fn


def test_flash_varlen_splits_calls_over_65535_documents(monkeypatch):
    calls: list = []
    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: _fake_flash(calls))
    s = 70_000
    doc = torch.arange(s).reshape(1, s)  # 70,000 one-token documents
    q = torch.randn(1, s, 2, 4)
    out = attention._flash_varlen(q, q, q, DocumentMask(doc))
    assert calls == [65_535, 70_000 - 65_535]
    assert_close(out, q)  # a one-token document attends to itself only


def test_split_flash_calls_compute_the_same_attention(monkeypatch):
    calls: list = []
    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: _fake_flash(calls))
    monkeypatch.setattr(attention, "FLASH_MAX_DOCS", 3)
    g = torch.Generator().manual_seed(0)
    doc = torch.cumsum(torch.rand(2, 96, generator=g) < 0.1, dim=1)
    q = torch.randn(2, 96, 4, 8, generator=g)
    k, v = torch.randn(2, 2, 96, 2, 8, generator=g).unbind(0)
    mask = DocumentMask(doc)
    got = attention._flash_varlen(q, k, v, mask)
    want = attention._sdpa_varlen(q, k, v, DocumentMask(doc))
    assert len(calls) > 2 and all(n <= 3 for n in calls)
    assert sum(calls) == sum(len(r) for r in mask.spans)
    assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- SDPA and GQA


def test_sdpa_takes_gqa_natively_only_where_its_flash_backend_runs():
    assert not sdpa_native_gqa("cuda", torch.float32)
    assert sdpa_native_gqa("cuda", torch.bfloat16) and sdpa_native_gqa("cuda", torch.float16)
    assert not sdpa_native_gqa("cuda", torch.bfloat16, masked=True)  # an explicit mask
    assert sdpa_native_gqa("cpu", torch.float32) and sdpa_native_gqa("cpu", torch.float32, True)


@pytest.mark.parametrize("kernel", ["sdpa_varlen", "sdpa_dense"])
def test_kernels_expand_kv_where_sdpa_cannot_take_gqa(kernel, monkeypatch):
    g = torch.Generator().manual_seed(1)
    doc = torch.cumsum(torch.rand(2, 64, generator=g) < 0.1, dim=1)
    q = torch.randn(2, 64, 8, 4, generator=g, requires_grad=True)
    k = torch.randn(2, 64, 2, 4, generator=g, requires_grad=True)
    v = torch.randn(2, 64, 2, 4, generator=g, requires_grad=True)
    fn = attention._IMPLS[kernel]
    native = fn(q, k, v, DocumentMask(doc))
    native_grads = torch.autograd.grad(native.square().sum(), (q, k, v))
    seen: list = []
    real = F.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        seen.append((k_.shape[1], kw.get("enable_gqa")))
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(attention, "sdpa_native_gqa", lambda *a, **kw: False)  # CUDA fp32
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    expanded = fn(q, k, v, DocumentMask(doc))
    assert seen and all(entry == (8, False) for entry in seen)  # 8 kv heads, no enable_gqa
    assert_close(expanded, native, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(expanded.square().sum(), (q, k, v)), native_grads):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_estimate_counts_the_expanded_kv_of_fp32_sdpa_on_gpu():
    gqa = load_config(
        RunConfig, CONFIGS / "small.yaml", ["model.num_key_value_heads=2", "parallel.sp=1"]
    )
    assert gqa.deepspeed.precision == "fp32" and gqa.model.num_attention_heads == 8
    e = estimate(gqa, 4096, EstimateOptions(gpus=1))
    cpu = estimate(gqa, 4096, EstimateOptions(gpus=1, device="cpu"))
    T, d = e.act.tokens, e.shape.head_dim
    Q, K = 8 * d, 2 * d
    # on the GPU k, v are saved at the 8 query heads instead of the 2 kv heads
    assert e.act.kernel_saved - cpu.act.kernel_saved == 2 * T * (Q - K) * 4
    # under SP the unexpanded k, v stay too (views of the all-to-all's receive buffer)
    sp2 = load_config(
        RunConfig, CONFIGS / "small.yaml", ["model.num_key_value_heads=2", "parallel.sp=2"]
    )
    e2, c2 = estimate(sp2, 4096), estimate(sp2, 4096, EstimateOptions(device="cpu"))
    assert e2.act.kernel_saved - c2.act.kernel_saved == 2 * e2.act.tokens * Q * 4
    # bf16 on a GPU runs flash-attn: GQA native, nothing expanded is saved
    bf = load_config(
        RunConfig,
        CONFIGS / "small.yaml",
        ["model.num_key_value_heads=2", "parallel.sp=1", "deepspeed.precision=bf16"],
    )
    eb, cb = (
        estimate(bf, 4096, EstimateOptions(gpus=1)),
        estimate(bf, 4096, EstimateOptions(gpus=1, device="cpu")),
    )
    assert eb.act.kernel_saved == cb.act.kernel_saved


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("position", [1_000_000, 1 << 25])
def test_rope_angles_match_fp64_at_chromosome_length_positions(position):
    head_dim, theta = 64, 500000.0
    rope = RotaryEmbedding(head_dim, theta)
    pos = torch.arange(position, position + 8).reshape(1, 8)
    cos, sin = rope(pos, torch.float32)  # [1, 8, d]
    inv = rope.inv_freq.double()  # Llama's fp32 frequencies, evaluated exactly
    angles = pos.double()[..., None] * inv
    want = torch.cat((angles, angles), dim=-1)
    assert_close(cos.double(), want.cos(), rtol=0, atol=2e-6)
    assert_close(sin.double(), want.sin(), rtol=0, atol=2e-6)


def test_rope_frequencies_stay_fp32_when_an_engine_casts_buffers():
    rope = RotaryEmbedding(64, 10000.0)
    fp32 = rope.inv_freq.clone()
    rope.bfloat16()  # what older DeepSpeed releases do to the whole module
    assert rope.inv_freq.dtype == torch.bfloat16
    pos = torch.tensor([[1_000_000]])
    cos, sin = rope(pos, torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, fp32)
    ref_cos, ref_sin = RotaryEmbedding(64, 10000.0)(pos, torch.bfloat16)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_rope_is_what_transformers_computes_where_fp32_is_exact():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = ModelConfig(modalities={"dna": 8}, rope={"theta": 500000.0})
    ours = build_model(cfg, seed=0).model.rotary_emb
    hf = LlamaRotaryEmbedding(LlamaConfig(vocab_size=16, **cfg.to_llama_config_kwargs()))
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    # transformers multiplies in fp32: off by up to half an ulp of the angle (7.6e-6 below
    # 128, 0.03 rad at 2^20); the same frequencies, so the same angles up to that rounding
    pos = torch.arange(128).reshape(1, -1)
    hc, hs = hf(torch.zeros(1, 128, 1), pos)
    oc, os_ = ours(pos, torch.float32)
    assert_close(oc, hc, rtol=0, atol=1e-5)
    assert_close(os_, hs, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- flex block mask


def _docs(b: int, s: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.rand(b, s, generator=g) < p, dim=1)


@pytest.mark.parametrize("s", [600, 1024, 2000])
def test_flex_block_mask_from_spans_is_create_block_masks(s):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = DocumentMask(_docs(2, s, 0.004, seed=s))
    got = mask.block_mask(4)
    r = mask.doc_index
    want = create_block_mask(
        lambda b, h, q, k: (q >= k) & (r[b, q] == r[b, k]), 2, None, s, s, device="cpu"
    )
    assert torch.equal(got.to_dense(), want.to_dense())
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    assert got.seq_lengths == (s, s)


def test_flex_block_mask_holds_what_the_estimate_counts_not_s_squared():
    b, s = 2, 16384
    mask = DocumentMask(_docs(b, s, 0.001, seed=0))
    _ = mask.doc_index, mask.spans  # shared with the other kernels; not the block mask's
    with TensorMemoryTracker() as t:
        block = mask.block_mask(4)
        held = t.live
    assert block is mask.block_mask(4)  # built once per batch
    counted = flex_block_mask_bytes(b, s)
    assert held == counted
    # the construction's transient stays a small multiple of it: nowhere near the
    # [b, 1, s, s] boolean mask (512 MiB here) that create_block_mask evaluates
    assert t.peak <= 3 * counted < b * s * s // 100


def test_estimate_counts_the_flex_block_mask():
    cfg = load_config(RunConfig, CONFIGS / "small.yaml", ["parallel.attention=flex"])
    base = load_config(RunConfig, CONFIGS / "small.yaml", ["parallel.attention=sdpa_varlen"])
    n = 1 << 18
    e, b = estimate(cfg, n), estimate(base, n)
    assert e.act.fixed - b.act.fixed == flex_block_mask_bytes(1, n) == 16 * 2048 * 2049
    assert any("block mask" in note for note in e.notes)


# --------------------------------------------------------------------------- NCCL reserve


def test_runtime_reserve_counts_nccl_per_communicator():
    cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml")
    per = NCCL_GIB_PER_COMMUNICATOR
    assert 0.5 <= per <= 1.6
    for gpus, sp, comms in ((1, 1, 0), (8, 8, 2), (8, 2, 3), (8, 1, 2), (16, 8, 3)):
        e = estimate(cfg, 8 * 8192, EstimateOptions(gpus=gpus, sp=sp))
        assert e.step.communicators == comms
        assert e.reserve == int((CONTEXT_RESERVE_GIB + per * comms) * GiB)
        assert e.total == e.peak + e.headroom + e.reserve
    # per-communicator figure as an option; a flat reserve replaces the computed one
    e = estimate(cfg, 65536, EstimateOptions(gpus=8, sp=2, nccl_gib=1.6))
    assert e.reserve == int((CONTEXT_RESERVE_GIB + 3 * 1.6) * GiB)
    assert estimate(cfg, 65536, EstimateOptions(gpus=8, reserve_gib=1.0)).reserve == GiB
    assert estimate(cfg, 65536, EstimateOptions(gpus=8, device="cpu")).reserve == 0


def test_cli_takes_the_nccl_figure(capsys):
    from ulysses_mm import cli

    cfg = str(CONFIGS / "llama3-8b.yaml")
    assert cli.main(["estimate", cfg, "--gpus", "8", "--seq-len", "65536"]) == 0
    default = capsys.readouterr().out
    assert "2 NCCL communicators" in default
    args = ["estimate", cfg, "--gpus", "8", "--seq-len", "65536", "--nccl-reserve", "1.5"]
    assert cli.main([*args, "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["reserve"] == int((CONTEXT_RESERVE_GIB + 2 * 1.5) * GiB)


def test_deepspeed_is_handed_the_host_model_and_peaks_start_after_set_up(monkeypatch):
    """Item 9: the fp32 model is never moved to the GPU before DeepSpeed casts it (a
    6 bytes/parameter transient), and the peak-memory counters are reset once the engine
    exists, so logged peaks are training's. A GPU world is faked: nothing touches CUDA."""
    from ulysses_mm.core.tokenspace import TokenSpace
    from ulysses_mm.parallel import Mesh
    from ulysses_mm.parallel.mesh import Place
    from ulysses_mm.train import step

    seen: dict[str, object] = {}

    def fake_engine(model, cfg, mesh, stage_lr=None):
        seen["devices"] = {p.device.type for p in model.parameters()}
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        seen["reset_after_engine"] = False
        return object(), object(), object()

    def reset(device=None):
        seen["reset_after_engine"] = "devices" in seen

    monkeypatch.setattr("ulysses_mm.train.engine.build_engine", fake_engine)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(step, "loss_weights", lambda mods, weights, device: None)
    monkeypatch.setattr(step, "resolve_kernel", lambda name, device, dtype: "sdpa_varlen")
    cfg = load_config(RunConfig, None, ["deepspeed.precision=bf16", "model.hidden_size=32"])
    place = Place(Mesh.single(), torch.device("cuda", 0), "nccl")
    setup = step.build_setup(cfg, TokenSpace.from_vocab({"dna": 10}), place)
    assert seen["devices"] == {"cpu"} and seen["dtypes"] == {torch.float32}
    assert seen["reset_after_engine"] is True
    assert setup.device == torch.device("cuda", 0)
