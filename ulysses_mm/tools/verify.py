"""``ulysses-mm verify``: does dp × sp on this cluster compute what one process computes?

Every rank builds the same small model and the same random packed multimodal batch, runs
forward and backward once as a single process would (the reference) and once sharded
dp × sp with Ulysses attention (× a ring when ``parallel.ring`` > 1), sums the parallel gradients over the world and compares:
the loss and every parameter's gradient, plus the all-to-all bytes each rank sent per
layer against theory (and the ring's bytes with a ring). Exit status 0 only when every difference is within tolerance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ulysses_mm.config import RunConfig, from_dict, to_dict
from ulysses_mm.config.parse import option
from ulysses_mm.core.checks import MAX_SEED
from ulysses_mm.core.layout import Layout, expanded_kv_heads
from ulysses_mm.core.tokenspace import DEFAULT_MODALITIES, TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model.attention import check_kernel_config, resolve_kernel
from ulysses_mm.parallel import CommStats, Mesh, RingAttention, launch, loss_weights, unmasked_pairs
from ulysses_mm.parallel.head_groups import exchange_heads
from ulysses_mm.parallel.mesh import in_launched_world, open_world
from ulysses_mm.parallel.ring import new_ring_stats, ring_theory_bytes
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.step import build_parallel_model, forward_backward


@dataclass
class VerifyOptions:
    """What verify runs beside the run config (whose ``parallel.sp``/``dp`` give the
    layout and whose model is checked)."""

    seq_len: int = option("tokens per sample N", 1024, ge=1, le=1 << 24)
    micro_batch: int = option("samples per DP rank", 1, ge=1, le=1 << 10)
    seed: int = option("seed of the random batch", 0, ge=0, le=MAX_SEED)
    atol: float = option("absolute tolerance", 1e-5, ge=0)
    rtol: float = option("tolerance relative to max |ref|", 1e-4, ge=0)


def theory_bytes_per_layer(cfg: RunConfig, opts: VerifyOptions, elem_bytes: int) -> tuple[int, int]:
    """(all-to-all bytes one rank sends per layer in forward: the MHA formula
    4·N·D/P·(P−1)/P, and the same with k, v at their real (GQA, replicated) width)."""
    m = cfg.model
    assert m.head_dim is not None
    layout = Layout(sp=cfg.parallel.sp, ring_size=cfg.parallel.ring)
    P, N, b = layout.ulysses_size, opts.seq_len, opts.micro_batch
    N //= layout.ring_size  # the all-to-all runs over the N/R tokens of one ring rank
    if P == 1:
        return 0, 0
    mha = 4 * N * m.hidden_size // P * (P - 1) // P * elem_bytes * b
    # q + out + k + v (in head groups, a kv head shared by several groups travels with each)
    heads, _ = exchange_heads(
        m.num_attention_heads, m.num_key_value_heads, P, cfg.parallel.head_groups
    )
    real = N * heads * m.head_dim // P * (P - 1) // P * elem_bytes * b
    return mha, real


def _flat_grads(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (n, p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    ]


def verify_worker(cfg_dict: dict[str, Any], opts: VerifyOptions) -> dict[str, Any]:
    cfg = from_dict(RunConfig, cfg_dict)
    place = open_world(cfg, deepspeed_comm=False)
    mesh, device = place.mesh, place.device
    kernel = resolve_kernel(cfg.parallel.attention, device.type, torch.float32)  # verify runs fp32
    space = TokenSpace.from_vocab(cfg.model.modalities or DEFAULT_MODALITIES)
    weights = loss_weights(space.modalities, cfg.model.loss_weights, device)
    b = opts.micro_batch
    global_batch = random_batch(space, mesh.dp * b, opts.seq_len, seed=opts.seed)
    rows = global_batch.rows(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    local = sp_slice(rows, mesh.sp_rank, mesh.sp, mesh.ring_size)

    # Parallel first: shape errors surface before the reference spends any time.
    stats = CommStats()
    model = build_parallel_model(cfg, space, mesh, kernel, stats).to(device)
    ring_stats = new_ring_stats()
    for mod in model.modules():
        if isinstance(mod, RingAttention):
            mod.stats = ring_stats
    _, par_report = forward_backward(model, local.to(device), weights, mesh)
    fwd_bytes = stats.forward_bytes
    grads = _flat_grads(model)
    if mesh.distributed:
        flat = torch.cat([g.reshape(-1) for _, g in grads])
        dist.all_reduce(flat, group=mesh.world_group)
        grads = list(zip([n for n, _ in grads], flat.split([g.numel() for _, g in grads])))

    single = Mesh.single()
    ref = build_parallel_model(cfg, space, single, kernel).to(device)
    _, ref_report = forward_backward(ref, global_batch.to(device), weights, single)
    rows_out = []
    ok = abs(par_report.total - ref_report.total) <= opts.atol + opts.rtol * abs(ref_report.total)
    for (name, g), (_, r) in zip(grads, _flat_grads(ref)):
        g = g.reshape(r.shape)
        diff = float((g - r).abs().max())
        scale = float(r.abs().max())
        good = diff <= opts.atol + opts.rtol * scale
        ok &= good
        rows_out.append((name, diff, scale, good))
    elem = next(model.parameters()).element_size()
    mha, real = theory_bytes_per_layer(cfg, opts, elem)
    m = cfg.model
    assert m.head_dim is not None
    ring_fwd, ring_bwd = ring_theory_bytes(
        opts.seq_len,
        mesh.ring_size,
        mesh.ulysses_size,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.head_dim,
        b,
        elem,
    )
    work = unmasked_pairs(rows.doc_ids, mesh.ring_size)
    return {
        "rank": mesh.rank,
        "ok": bool(ok),
        "mesh": mesh.describe(),
        "sp": mesh.sp,
        "dp": mesh.dp,
        "ring_size": mesh.ring_size,
        "ring_fwd": ring_stats["forward_bytes"] / max(1, ring_stats["forward_calls"]),
        "ring_bwd": ring_stats["backward_bytes"] / max(1, ring_stats["backward_calls"]),
        "ring_theory": (ring_fwd, ring_bwd),
        "ring_skipped": ring_stats["skipped"],
        "ring_work": work,
        "kernel": kernel,
        "backend": place.backend,
        "loss_single": ref_report.total,
        "loss_parallel": par_report.total,
        "per_modality_single": ref_report.per_modality,
        "per_modality_parallel": par_report.per_modality,
        "counts": ref_report.counts,
        "grads": rows_out,
        # two exchanges per layer call and head group; activation checkpointing
        # recomputes (and re-sends)
        "bytes_per_layer": fwd_bytes
        / max(1, stats.forward_calls // (2 * cfg.parallel.head_groups)),
        "theory_mha": mha,
        "theory_real": real,
        "documents": int(sum(len(torch.unique(d)) for d in global_batch.doc_ids)),
    }


def format_report(cfg: RunConfig, opts: VerifyOptions, results: list[dict[str, Any]]) -> str:
    r0 = results[0]
    m = cfg.model
    sp, dp, ring = r0["sp"], r0["dp"], r0.get("ring_size", 1)
    u = sp // ring
    e = expanded_kv_heads(m.num_attention_heads, m.num_key_value_heads, u)
    hybrid = f" (ulysses {u} × ring {ring})" if ring > 1 else ""
    lines = [
        f"ulysses-mm verify: dp={dp} × sp={sp}{hybrid} ({dp * sp} processes, "
        f"backend {r0['backend']}, kernel {r0['kernel']})",
        f"model: {m.num_hidden_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads}/"
        f"{m.num_key_value_heads} kv (replicated to {e} for ulysses={u}); batch "
        f"{dp * opts.micro_batch} × {opts.seq_len} tokens, {r0['documents']} documents",
        "",
        f"loss        single {r0['loss_single']:.8f}   parallel {r0['loss_parallel']:.8f}   "
        f"|diff| {abs(r0['loss_single'] - r0['loss_parallel']):.3e}",
    ]
    for mod, v in r0["per_modality_single"].items():
        pv = r0["per_modality_parallel"].get(mod, math.nan)
        lines.append(
            f"  {mod:<10s}single {v:.8f}   parallel {pv:.8f}   targets {r0['counts'][mod]}"
        )
    worst: dict[str, tuple[float, float, bool]] = {}
    for res in results:
        for name, diff, scale, good in res["grads"]:
            prev = worst.get(name)
            if prev is None or diff > prev[0]:
                worst[name] = (diff, scale, good)
    lines += ["", f"gradients (max |diff| over {len(results)} ranks, max |grad| of the reference):"]
    width = max(len(n) for n in worst)
    for name, (diff, scale, good) in worst.items():
        lines.append(f"  {name:<{width}s}  {diff:.3e}  {scale:.3e}  {'ok' if good else 'FAIL'}")
    if u > 1:
        measured = max(res["bytes_per_layer"] for res in results)
        lines += [
            "",
            "all-to-all bytes sent per rank per layer (forward):",
            f"  measured {measured:,.0f}   theory 4·N·D/P·(P−1)/P = {r0['theory_mha']:,}   "
            f"with real k/v width {r0['theory_real']:,}   ratio {measured / r0['theory_real']:.4f}",
        ]
    if ring > 1:
        fwd = max(res["ring_fwd"] for res in results)
        bwd = max(res["ring_bwd"] for res in results)
        tf, tb = r0["ring_theory"]
        work = r0["ring_work"]
        lines += [
            "",
            "ring bytes sent per rank per layer (K/V blocks forward; K/V and dK/dV backward):",
            f"  forward  measured {fwd:,.0f}   theory (R−1)·2·N/R·e/U·d = {tf:,}",
            f"  backward measured {bwd:,.0f}   theory + R·dK/dV = {tb:,}",
            f"  blocks skipped (no query may see them): {sum(r['ring_skipped'] for r in results)}",
            f"  unmasked query-key pairs per ring rank (document zigzag): {work}   "
            f"max/min {max(work) / max(1, min(work)):.3f}",
        ]
    ok = all(res["ok"] for res in results)
    lines += [
        "",
        "PASS: dp × sp matches one process" if ok else "FAIL: differences exceed tolerance",
    ]
    return "\n".join(lines)


def verify_against_one_process(cfg: RunConfig, opts: VerifyOptions) -> int:
    """dp × sp (``parallel.dp`` × ``parallel.sp``; dp 0 = 1 when verify starts its own
    processes) against one process; 0 when every difference is within tolerance."""

    p, m = cfg.parallel, cfg.model
    check_kernel_config(p.attention, "fp32")  # verify compares in fp32
    launched = in_launched_world()
    # verify starts dp × sp processes itself unless a launcher made the world (then the
    # layout must fill it); its own world has no size to fit, so a refusal lists every sp
    # size the model and the length allow
    shape = dict(
        num_heads=m.num_attention_heads, num_kv_heads=m.num_key_value_heads, seq_len=opts.seq_len
    )
    if launched:
        layout = Layout.from_config(p, int(os.environ["WORLD_SIZE"]), **shape)
    else:
        layout = Layout(p.dp or 1, p.sp, p.ring, p.head_groups).check(**shape)
    results = launch.run_world(verify_worker, layout.world_size, to_dict(cfg), opts)
    if launched and results[0]["rank"] != 0:
        # Only rank 0 prints (its own view: the gradients are already summed globally).
        return 0 if results[0]["ok"] else 1
    print(format_report(cfg, opts, results))
    return 0 if all(r["ok"] for r in results) else 1
