"""The memory estimate (ulysses_mm.tools.estimate) against measurement, and its arithmetic.

The contract: for configs/debug-tiny.yaml and configs/small.yaml, one real training step
(the DeepSpeed engine of ``ulysses-mm train``, gloo, SP=1 and SP=2) is measured with
:class:`~ulysses_mm.tools.memory.TensorMemoryTracker` (ulysses_mm.tools.measure) and compared with
``estimate(device="cpu")``: the peak and the part of it above what was live before the
step (activations, gradients, buffers, optimizer temporaries) agree within 15 %.
debug-tiny at 8,192 tokens is activation-bound at both SP sizes; small (ZeRO-1,
checkpointed, tiled) is optimizer-step-bound at SP=1 (1,024 tokens) and activation-bound at
SP=2 (2,048). Two more cases on debug-tiny's shape cover bf16 with ZeRO-2 and ZeRO-3, and
four the memory modes (checkpoints offloaded to the host, the sequence-tiled layer) on
debug-tiny deepened to 8 checkpointed layers at 16,384 tokens; there the host memory the
offload holds is measured apart from the peak and must be the estimate's. Three more run
hybrid Ulysses × ring (parallel.ring = 2) in a world of 4: (U, R) = (1, 2) under dp 2 in
fp32 and in bf16 with ZeRO-2 and checkpointing, and (2, 2); at 1,024 tokens the ring's dense
per-block scores ([b, hq/U, N/R, N/R] fp32, five at once in backward) are most of the peak.
Three run attention in head groups (``parallel.head_groups``): C = 2 and 4 at SP=2 with
heads four times wider than the model and the memory modes on (the groups' attention sets
at the peak), and C = 4 under the ring (1, 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gloo import run_distributed

from ulysses_mm import cli
from ulysses_mm.config import RunConfig, load_config, to_dict
from ulysses_mm.loader.synthetic import largest_head, single_modality_batch
from ulysses_mm.tools.estimate import (
    DS_ZERO_DEFAULTS,
    MAX_GRANULARITY,
    EstimateOptions,
    GiB,
    best_head_groups,
    estimate,
    max_seq_len,
    model_shape,
    step_shape,
    token_space,
)
from ulysses_mm.tools.measure import measure_worker, run_space

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TOLERANCE = 0.15
SMALL_BUCKETS = "deepspeed.extra={zero_optimization: {reduce_bucket_size: 200000}}"

# the memory modes, on debug-tiny's shape deepened to 8 checkpointed layers (activation-bound)
DEEP = ["model.num_hidden_layers=8", "model.activation_checkpointing=true"]
OFFLOAD = ["model.offload_checkpoints=true"]
TILES = ["model.layer_tile_tokens=1024"]
RING = ["parallel.ring=2"]
# attention in head groups: heads wider than the model (8 × 32 = 4 D), the memory modes on
WIDE = [
    "model.num_attention_heads=8",
    "model.head_dim=32",
    "model.num_hidden_layers=4",
    "model.activation_checkpointing=true",
    "model.offload_checkpoints=true",
    "model.layer_tile_tokens=512",
    "model.loss_tile_tokens=256",
]
# (id, config file, overrides, seq_len, sp)
CASES = [
    ("debug-tiny-sp1", "debug-tiny.yaml", [], 8192, 1),
    ("debug-tiny-sp2", "debug-tiny.yaml", [], 8192, 2),
    ("small-sp1", "small.yaml", [], 1024, 1),
    ("small-sp2", "small.yaml", [], 2048, 2),
    (
        "debug-tiny-bf16-zero2-ckpt-sp2",
        "debug-tiny.yaml",
        [
            "deepspeed.precision=bf16",
            "deepspeed.zero_stage=2",
            "model.activation_checkpointing=true",
            SMALL_BUCKETS,
        ],
        4096,
        2,
    ),
    *[
        (
            f"debug-tiny-8-layers-{mode}-sp{sp}",
            "debug-tiny.yaml",
            [*DEEP, *switches],
            16384,
            sp,
        )
        for sp, mode, switches in (
            (1, "offload", OFFLOAD),
            (1, "offload-tiles", [*OFFLOAD, *TILES]),
            (2, "tiles", TILES),
            (2, "offload-tiles", [*OFFLOAD, *TILES]),
        )
    ],
    (
        "debug-tiny-bf16-zero3-sp2",
        "debug-tiny.yaml",
        ["deepspeed.precision=bf16", "deepspeed.zero_stage=3", SMALL_BUCKETS],
        4096,
        2,
    ),
    ("debug-tiny-ring-u1-r2-dp2", "debug-tiny.yaml", [*RING, "parallel.dp=2"], 1024, 2),
    *[
        (
            f"debug-tiny-wide-heads-chunks{c}-sp2",
            "debug-tiny.yaml",
            [*WIDE, f"parallel.head_groups={c}"],
            4096,
            2,
        )
        for c in (2, 4)
    ],
    (
        "debug-tiny-ring-u1-r2-chunks4",
        "debug-tiny.yaml",
        [*RING, "model.num_attention_heads=8", "parallel.head_groups=4"],
        1024,
        2,
    ),
    ("debug-tiny-ring-u2-r2", "debug-tiny.yaml", RING, 1024, 4),
    (
        "debug-tiny-ring-u1-r2-bf16-zero2-ckpt-dp2",
        "debug-tiny.yaml",
        [
            *RING,
            "parallel.dp=2",
            "deepspeed.precision=bf16",
            "deepspeed.zero_stage=2",
            "model.activation_checkpointing=true",
            SMALL_BUCKETS,
        ],
        1024,
        2,
    ),
]


def _cfg(name: str, overrides: list[str], sp: int) -> RunConfig:
    return load_config(RunConfig, CONFIGS / name, [*overrides, f"parallel.sp={sp}"])


def _measure_cases(rank: int, world: int, cases: list) -> dict:
    out = {}
    for case_id, name, overrides, seq_len, sp in cases:
        cfg = _cfg(name, overrides, sp)
        out[case_id] = measure_worker(rank, world, to_dict(cfg), seq_len, 1024)
    return out


def _world(case) -> int:
    _, name, overrides, _, sp = case
    return sp * (_cfg(name, overrides, sp).parallel.dp or 1)


@pytest.fixture(scope="module")
def measured() -> Callable[[str], dict]:
    """A case's measurement: on first use, every case of its world size (1, 2 or 4
    processes) is measured in one world."""
    results: dict = {}

    def get(case_id: str) -> dict:
        if case_id not in results:
            world = _world(next(c for c in CASES if c[0] == case_id))
            cases = [c for c in CASES if _world(c) == world]
            per_rank = run_distributed(_measure_cases, world, cases, timeout=300)
            for cid, *_ in cases:
                results[cid] = max((r[cid] for r in per_rank), key=lambda r: r["peak"])
        return results[case_id]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_estimate_matches_measured_peak(measured, case):
    case_id, name, overrides, seq_len, sp = case
    cfg = _cfg(name, overrides, sp)
    est = estimate(cfg, seq_len, EstimateOptions(device="cpu"))
    m = measured(case_id)
    assert m["sp"] == sp and m["seq_len"] == seq_len
    before = est.phase("optimizer step")  # what is live between steps, as estimated
    est_base = sum(
        t.bytes for t in before.terms if t.name not in ("gradients", "optimizer step temporaries")
    )
    ratio = est.peak / m["peak"]
    above = (est.peak - est_base) / (m["peak"] - m["base"])
    report = (
        f"{case_id}: estimated {est.peak / 2**20:.2f} MiB ({est.peak_phase}), measured "
        f"{m['peak'] / 2**20:.2f} MiB; above the step's start: estimated "
        f"{(est.peak - est_base) / 2**20:.2f}, measured {(m['peak'] - m['base']) / 2**20:.2f}"
    )
    assert abs(ratio - 1) <= TOLERANCE, report
    assert abs(above - 1) <= TOLERANCE, report
    # what offloaded checkpoints hold on the host, counted apart: every layer's input
    assert m["host"] == (est.host if cfg.model.offload_checkpoints else 0), report
    # what is live between steps (parameters, optimizer states, buffers, the batch)
    assert est_base == pytest.approx(m["base"], rel=TOLERANCE), report


def test_measurement_batch_is_the_worst_case():
    space = run_space(_cfg("debug-tiny.yaml", [], 1))
    batch = single_modality_batch(space, 2, 300, 128)
    widest = space.index(largest_head(space))
    assert space.ranges[widest].size == max(r.size for r in space.ranges)
    targets = batch.label_modality[batch.labels != -100]
    assert targets.numel() > 250 and bool((targets == widest).all())
    for row in batch.doc_ids:  # documents of 128 tokens, the last one cut at the sample end
        assert len(torch.unique(row)) == math.ceil(300 / 128)


def test_zero_defaults_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig()
    assert DS_ZERO_DEFAULTS["reduce_bucket_size"] == z.reduce_bucket_size
    assert DS_ZERO_DEFAULTS["contiguous_gradients"] == z.contiguous_gradients
    assert DS_ZERO_DEFAULTS["stage3_param_persistence_threshold"] == z.param_persistence_threshold
    assert DS_ZERO_DEFAULTS["stage3_max_live_parameters"] == z.max_live_parameters
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True
    assert DeepSpeedZeroConfig(stage=2).overlap_comm is False


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_parameter_count_is_the_models(path: Path):
    from ulysses_mm.model import build_model

    cfg = load_config(RunConfig, path)
    space, _ = token_space(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, space)
    assert model_shape(cfg, space).params == sum(p.numel() for p in model.parameters())


def test_ready_made_shapes():
    """The well-known shapes, less their (here tiny) vocabularies: Llama-3.2-1B has 0.97 B
    parameters outside the embeddings, Qwen3-4B 3.6 B, Llama-3-8B 6.98 B."""
    expect = {"llama-1b.yaml": 0.97e9, "qwen3-4b.yaml": 3.6e9, "llama3-8b.yaml": 6.98e9}
    for name, params in expect.items():
        cfg = load_config(RunConfig, CONFIGS / name)
        space, _ = token_space(cfg)
        assert model_shape(cfg, space).params == pytest.approx(params, rel=0.03), name
        assert cfg.deepspeed.precision == "bf16" and cfg.model.activation_checkpointing


def test_step_shape_defaults_and_refusals():
    cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml")
    assert step_shape(cfg, 8192, None, None).sp == 8  # parallel.sp
    lay = step_shape(cfg, 8192, 16, None)
    assert (lay.sp, lay.dp) == (16, 1)  # --gpus alone: one SP group over all of them
    lay = step_shape(cfg, 8192, 16, 8)
    assert (lay.sp, lay.dp, lay.tokens) == (8, 2, 1024)
    with pytest.raises(ValueError, match=r"sp=3 .* sp sizes that do: \[1, 2, 4, 8\]"):
        step_shape(cfg, 8192, 8, 3)
    with pytest.raises(ValueError, match="sp=8 does not divide the sequence of 1001 tokens"):
        step_shape(cfg, 1001, 8, None)


def test_more_gpus_and_checkpointing_and_zero_lower_the_per_gpu_figure():
    cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml")
    n = 262144
    by_sp = [estimate(cfg, n, EstimateOptions(gpus=g)).peak for g in (2, 4, 8)]
    assert by_sp[0] > by_sp[1] > by_sp[2]
    no_ckpt = load_config(
        RunConfig,
        CONFIGS / "llama3-8b.yaml",
        ["model.activation_checkpointing=false", "model.offload_checkpoints=false"],
    )
    assert (
        estimate(no_ckpt, n, EstimateOptions(gpus=8)).peak
        > 2 * estimate(cfg, n, EstimateOptions(gpus=8)).peak
    )
    zero1 = load_config(RunConfig, CONFIGS / "llama3-8b.yaml", ["deepspeed.zero_stage=1"])
    e1, e3 = estimate(zero1, n, EstimateOptions(gpus=8)), estimate(cfg, n, EstimateOptions(gpus=8))
    assert e1.states["params"] == 2 * e1.params  # bf16, whole on every rank
    assert e3.states["params"] < e1.states["params"] / 7
    assert e1.states["optimizer"] == e3.states["optimizer"] == 12 * math.ceil(e1.params / 8)
    off = load_config(
        RunConfig,
        CONFIGS / "llama3-8b.yaml",
        ["deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"],
    )
    eo = estimate(off, n, EstimateOptions(gpus=8))
    assert eo.states["optimizer"] == 0 and eo.host >= 16 * e3.params // 8
    assert eo.peak < e3.peak
    # the what-if: with the checkpointed layer inputs on the host the peak drops by ~L - 1 of them
    kept = load_config(
        RunConfig,
        CONFIGS / "llama3-8b.yaml",
        ["model.offload_checkpoints=false", "model.layer_tile_tokens=0"],
    )
    e3 = estimate(kept, n, EstimateOptions(gpus=8))
    assert e3.offloaded_total is not None
    saved = e3.total - e3.offloaded_total
    assert saved >= 0.9 * (cfg.model.num_hidden_layers - 1) * e3.act.residual


def test_gpu_terms_only_on_gpu():
    cfg = load_config(RunConfig, CONFIGS / "small.yaml")
    gpu = estimate(cfg, 4096, EstimateOptions(headroom=0.2, reserve_gib=1.5))
    cpu = estimate(cfg, 4096, EstimateOptions(device="cpu"))
    assert gpu.reserve == int(1.5 * GiB) and gpu.headroom == int(0.2 * gpu.peak)
    assert gpu.total == gpu.peak + gpu.headroom + gpu.reserve
    assert cpu.total == cpu.peak and cpu.reserve == 0 and cpu.headroom == 0


def test_max_seq_len_is_the_longest_that_fits():
    cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml")
    n24, e24 = max_seq_len(cfg, EstimateOptions(gpu_mem_gib=24, gpus=8))
    n80, e80 = max_seq_len(cfg, EstimateOptions(gpu_mem_gib=80, gpus=8))
    g = 8 * MAX_GRANULARITY
    assert 0 < n24 < n80 and n24 % g == 0 and n80 % g == 0
    for n, e, mem in ((n24, e24, 24), (n80, e80, 80)):
        assert e.fits and e.step.seq_len == n and e.total <= mem * GiB
        assert not estimate(cfg, n + g, EstimateOptions(gpus=8, gpu_mem_gib=mem)).fits
    # nothing fits when the states alone exceed the GPU
    n, e = max_seq_len(cfg, EstimateOptions(gpu_mem_gib=4, gpus=8))
    assert n == 0 and not e.fits


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["estimate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_answers_how_long_a_context_fits(capsys):
    cfg = str(CONFIGS / "llama3-8b.yaml")
    rc, out, _ = _cli(capsys, cfg, "--gpus", "8", "--gpu-mem", "24", "--max")
    assert rc == 0
    n, _ = max_seq_len(load_config(RunConfig, cfg), EstimateOptions(gpu_mem_gib=24, gpus=8))
    assert (
        f"longest sequence that fits: {n:,} tokens ({n // 8:,} per GPU) on 8 GPUs of 24 GiB" in out
    )
    for line in (
        "parameters",
        "optimizer states",
        "gradients, at the peak",
        "saved, without checkpointing",
        "kept, with checkpointing (the layer input)",
        "kept, checkpoints offloaded to host (fetched + prefetched)",
        "q, k, v after the all-to-all",
        "communication buffers",
        "all-to-all send + receive (one exchange of q, k, v)",
        "DeepSpeed buckets and gathered parameters",
        "layer tile of 8,192 tokens, backward",
        "loss tile of 8,192 tokens × 263 logits",
        "allocator headroom, 10% of the peak",
        "of 24 GiB: fits",
    ):
        assert line in out, line
    rc, out, _ = _cli(capsys, cfg, "--gpus", "8", "--seq-len", "65536", "--json", "--device", "cpu")
    data = json.loads(out)
    assert rc == 0 and data["layout"]["tokens"] == 8192 and data["device"] == "cpu"
    assert data["total"] == data["peak"] and data["peak_phase"] in data["phases"]
    rc, out, _ = _cli(capsys, cfg, "--gpus", "8", "--gpu-mem", "24", "--seq-len", "4194304")
    assert rc == 0 and "DOES NOT FIT" in out


def test_cli_refusals(capsys):
    cfg = str(CONFIGS / "llama3-8b.yaml")
    rc, _, err = _cli(capsys, cfg)
    assert rc == 2 and "give --seq-len N or --max" in err
    rc, _, err = _cli(capsys, cfg, "--max")
    assert rc == 2 and "--max needs --gpu-mem" in err
    rc, _, err = _cli(capsys, cfg, "--gpus", "6", "--seq-len", "6144")
    assert rc == 2 and "sp=6 does not divide the 32 query heads" in err
    rc, _, err = _cli(capsys, cfg, "model.hidden_szie=3", "--seq-len", "8192")
    assert rc == 2 and "did you mean 'model.hidden_size'" in err


def test_gradient_accumulation_keeps_gradients_through_the_next_micro_step():
    cfg = load_config(RunConfig, CONFIGS / "debug-tiny.yaml")
    gas = load_config(
        RunConfig, CONFIGS / "debug-tiny.yaml", ["deepspeed.gradient_accumulation_steps=4"]
    )
    one, four = (
        estimate(cfg, 8192, EstimateOptions(device="cpu")),
        estimate(gas, 8192, EstimateOptions(device="cpu")),
    )
    grads = 4 * one.params  # fp32, ZeRO-0: every gradient, held between micro-steps
    fwd = "forward: the last layer's attention"
    assert four.phase(fwd).bytes - one.phase(fwd).bytes == grads
    assert four.peak > one.peak


def test_ring_is_estimated_with_its_bytes(capsys):
    """parallel.ring = R is estimated: the ring's bytes per rank per layer are
    ring_theory_bytes, the all-to-all's verify's theory over U = sp / R, and the figures
    reach the text and the JSON."""
    from ulysses_mm.parallel.ring import ring_theory_bytes
    from ulysses_mm.tools.verify import VerifyOptions, theory_bytes_per_layer

    n = 262144
    for ring in (2, 4, 8):
        cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml", [f"parallel.ring={ring}"])
        est = estimate(cfg, n, EstimateOptions(gpus=16))
        lay, sent = est.step, est.sent_per_layer
        # a GPU in bf16 runs the ring's blocks as flash-attn varlen calls
        assert (lay.sp, lay.ring_size, lay.ulysses_size) == (16, ring, 16 // ring)
        assert est.kernel == "ring_flash"
        assert (sent["ring_forward"], sent["ring_backward"]) == ring_theory_bytes(
            n, ring, 16 // ring, 32, 8, 128, 1, elem_bytes=2
        )
        cfg.parallel.sp = 16
        _, a2a = theory_bytes_per_layer(cfg, VerifyOptions(seq_len=n), 2)
        assert sent["all_to_all_forward"] == sent["all_to_all_backward"] == a2a
        # no (N/R)² term with flash: a 262k-token step of llama3-8b fits 16 H200-sized GPUs
        assert est.act.ring_scores == 0
        assert est.peak < 141e9, est.peak
        # the PyTorch block kernel (fp32, no flash): five [hq/U, N/R, N/R] fp32 in backward
        fp32 = estimate(
            load_config(
                RunConfig,
                CONFIGS / "llama3-8b.yaml",
                [f"parallel.ring={ring}", "deepspeed.precision=fp32"],
            ),
            n,
            EstimateOptions(gpus=16),
        )
        assert fp32.kernel == "ring"
        assert fp32.act.ring_scores == 4 * (32 // (16 // ring)) * (n // ring) ** 2
        assert fp32.act.attention_backward >= 5 * fp32.act.ring_scores
    # the pure ring (U = 1) moves no all-to-all bytes and needs no heads to divide sp
    cfg = load_config(RunConfig, CONFIGS / "debug-tiny.yaml", ["parallel.sp=8", "parallel.ring=8"])
    est = estimate(cfg, 4096, EstimateOptions(gpus=8))
    assert est.step.ulysses_size == 1 and est.sent_per_layer["all_to_all_forward"] == 0
    m, sent = cfg.model, est.sent_per_layer
    assert (sent["ring_forward"], sent["ring_backward"]) == ring_theory_bytes(
        4096, 8, 1, m.num_attention_heads, m.num_key_value_heads, m.head_dim, 1, elem_bytes=4
    )  # fp32

    tiny = str(CONFIGS / "debug-tiny.yaml")
    rc, out, _ = _cli(capsys, tiny, "--seq-len", "1024", "parallel.sp=4", "parallel.ring=2")
    assert rc == 0
    for line in (
        "dp 1 × sp 4 (ulysses 2 × ring 2)",
        "ring block scores [2, 512, 512] fp32 (per row)",
        "all-to-all over ulysses 2",
        "ring of 2 (K/V blocks; backward + dK/dV)",
        "kernel ring",
    ):
        assert line in out, line
    args = ["--seq-len", "1024", "--json", "parallel.sp=4", "parallel.ring=2"]
    rc, out, _ = _cli(capsys, tiny, *args)
    data = json.loads(out)
    assert rc == 0 and data["layout"]["ring_size"] == 2
    assert (data["sent_per_layer"]["ring_forward"], data["sent_per_layer"]["ring_backward"]) == (
        ring_theory_bytes(1024, 2, 2, 4, 2, 16, 1, elem_bytes=4)
    )
    args = ["--seq-len", "1024", "--sp", "6", "parallel.sp=4", "parallel.ring=4"]
    rc, _, err = _cli(capsys, tiny, *args)
    assert rc == 2 and "ring=4 does not divide sp=6" in err


GOAL = [
    "deepspeed.offload_optimizer=cpu",
    "deepspeed.offload_param=cpu",
    "model.modalities={text: 128256, dna: 10, audio: 256, video: 256}",
]


def test_head_groups_reach_1m_tokens_on_one_gpu_and_8m_on_eight():
    """Llama-3-8B (text vocabulary 128,256 beside the shipped modalities, bf16, ZeRO-3,
    optimizer and parameters offloaded): 1,000,000 tokens fit one 80 GiB GPU and
    8,000,000 fit eight, in head groups and not without them, within 2 TiB of host memory
    per node."""
    cfg = load_config(RunConfig, CONFIGS / "llama3-8b.yaml", GOAL)
    for gpus, n, chunks in ((1, 1_000_000, 16), (8, 8_000_000, 4)):
        kw = dict(gpus=gpus, gpu_mem_gib=80, host_mem_gib=2048)
        grouped = estimate(cfg, n, EstimateOptions(head_groups=chunks, **kw))
        assert grouped.fits and grouped.host_fits, (gpus, grouped.total / GiB)
        assert not estimate(cfg, n, EstimateOptions(head_groups=1, **kw)).fits
        # the groups shrink what attention keeps and works with
        one = estimate(cfg, n, EstimateOptions(head_groups=1, **kw))
        assert grouped.act.kernel_saved < one.act.kernel_saved
        assert grouped.act.attention_backward < one.act.attention_backward
        longest, est, tried = best_head_groups(
            cfg, EstimateOptions(gpu_mem_gib=80, gpus=gpus, host_mem_gib=2048)
        )
        assert longest >= n and est.step.head_groups == max(tried, key=tried.get)
    # the exchange carries q, k, v again in backward (the recomputation)
    from ulysses_mm.parallel.head_groups import exchange_heads

    est = estimate(cfg, 8_000_000, EstimateOptions(gpus=8, head_groups=4))
    fwd, bwd = exchange_heads(32, 8, 8, 4)
    per_head = 8_000_000 * 128 // 8 * 7 // 8 * 2
    assert est.sent_per_layer["all_to_all_forward"] == fwd * per_head
    assert est.sent_per_layer["all_to_all_backward"] == bwd * per_head


def test_cli_head_groups_and_host_memory(capsys):
    cfg = str(CONFIGS / "llama3-8b.yaml")
    args = [cfg, *GOAL, "--gpu-mem", "80"]
    rc, out, _ = _cli(capsys, *args, "--gpus", "8", "--max", "--head-groups", "auto")
    assert rc == 0 and "head groups auto: 4 (longest sequence by head groups: 1: " in out
    assert "attention in 4 head groups" in out and "of 2048 GiB (--host-mem)" in out
    n = int(out.split("longest sequence that fits: ")[1].split(" tokens")[0].replace(",", ""))
    assert n >= 8_000_000
    # a plan over the node's host memory: one line, exit 2
    rc, out, err = _cli(capsys, *args, "--gpus", "8", "--seq-len", "9000000", "--head-groups", "4")
    assert rc == 2 and err.count("\n") == 1
    assert "host memory:" in err and "more than --host-mem 2048 GiB" in err
    # --max keeps within it
    rc, out, _ = _cli(capsys, *args, "--gpus", "8", "--max", "--head-groups", "4", "--json")
    data = json.loads(out)
    assert rc == 0 and data["host_fits"] and data["host_per_node"] <= 2048 * GiB
    rc, _, err = _cli(capsys, *args, "--gpus", "8", "--max", "--host-mem", "100")
    assert rc == 2 and "host memory:" in err
    # head groups that do not split the heads: one line naming what works
    rc, _, err = _cli(capsys, *args, "--gpus", "8", "--seq-len", "65536", "--head-groups", "3")
    assert rc == 2 and "head_groups=3" in err and "[1, 2, 4]" in err
    rc, _, err = _cli(capsys, *args, "--seq-len", "65536", "--head-groups", "x")
    assert rc == 2 and "--head-groups must be" in err and "auto" in err
