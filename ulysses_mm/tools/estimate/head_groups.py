"""Attention in C groups of heads (``parallel.head_groups`` > 1, in place of the all-heads
sets of :mod:`ulysses_mm.tools.estimate.activations`).

:mod:`ulysses_mm.parallel.head_groups` keeps the caller's q, k, v [T, Q + 2K] for backward
(not the kernel's saved set) and fills one output buffer [T, Q]; one group's q, k, v after
the all-to-all, its kernel and their exchanges are alive at a time. A group holds, over
the whole sequence of the kernel, hq/C query heads (Qg = Q/C) and U·eg kv heads (Kg; eg =
e/(U·C), or 1 when the group reads one shared kv head). Backward recomputes each group in
order: its q, k, v and output gradient arrive, the kernel runs forward and back, the
gradients go home into dk, dv [T, 2K] and into the output gradient's own copy as dq. On
CUDA the forward's next group travels during a group's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ulysses_mm.core.layout import head_group_sizes
from ulysses_mm.tools.estimate.ring import ring_working_sets
from ulysses_mm.tools.estimate.shape import ModelShape, StepShape


@dataclass
class GroupedSets:
    """Bytes of grouped attention on one rank."""

    kernel_saved: int  # what the layer keeps for it: the caller's q, k, v
    group: int  # one group's q, k, v after the all-to-all
    exchange: int  # send + receive of the largest exchange (a group's backward inputs)
    forward: int  # the forward's working set beyond what is kept (the output buffer in it)
    backward: int  # the backward's, beyond what is kept (dq, dk, dv in it)


def group_heads(sh: ModelShape, U: int, C: int) -> tuple[int, int, bool]:
    """(query heads, kv heads) of one group on one rank over all U sequence chunks, and
    whether its kv heads are gathered by index (replicated or shared heads)."""
    hg, eg = head_group_sizes(sh.heads, sh.kv_heads, U, C)
    return U * hg, U * eg, sh.kv_expanded(U) != sh.kv_heads


def grouped_sets(
    sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str, tiled: bool
) -> GroupedSets:
    """The sets of grouped attention at ``a`` bytes per element under ``kernel`` (the one
    that runs, or ``ring`` / ``ring_flash``); ``tiled``: a sequence-tiled layer, whose
    kernel-output gradient is not counted elsewhere."""
    T, U, C = step.tokens, step.ulysses_size, step.head_groups
    d, Q, K = sh.head_dim, sh.q_width, sh.kv_width
    hg, kg, index = group_heads(sh, U, C)
    Qg, Kg = hg * d, kg * d
    qkv_g = T * (Qg + 2 * Kg) * a  # one group's q, k, v (over the whole sequence)
    bwd_in = T * (2 * Qg + 2 * Kg) * a  # ... and its output gradient
    og = T * Qg * a
    lse = 4 * T * sh.heads // C
    temps = 2 * T * Kg * a if index else 0  # replicated k, v gathered before they travel
    flash = kernel in ("flash_varlen", "ring_flash")
    # inputs as the kernel sees them: what arrived (U > 1), contiguous copies of the
    # group's head views (flash-attn, U = 1), or the views and gathered k, v themselves
    held_fwd = qkv_g if (U > 1 or flash) else temps
    held_bwd = bwd_in if (U > 1 or flash) else temps
    if kernel in ("ring", "ring_flash"):
        group_shape = replace(sh, heads=hg, kv_heads=kg)
        _, ring_fwd, ring_bwd = ring_working_sets(group_shape, step, a, kernel == "ring_flash")
        k_fwd = ring_fwd + 4 * T * Qg + lse  # and its fp32 output
        k_bwd = ring_bwd + T * Qg * (a + 4) + lse  # recomputed output, and its fp32 copy
    elif flash:
        k_fwd = og + lse
        gqa = 2 * T * Qg * a if hg > kg else 0  # dk, dv expanded to the query heads
        # recomputed output and lse; dq, dk, dv, the fp32 dq accumulator
        k_bwd = og + lse + T * (Qg + 2 * Kg) * a + 4 * T * Qg + gqa
    else:
        # SDPA per document: the documents' outputs, their concatenation per row and of
        # the rows; backward: the saved outputs and the recomputed one, the documents'
        # gradients and their concatenation
        k_fwd = 3 * og + lse
        k_bwd = 2 * og + lse + 2 * T * (Qg + 2 * Kg) * a
    grads_g = T * (Qg + 2 * Kg) * a
    out = T * Q * a
    forward = out + max(
        temps + 2 * qkv_g if U > 1 else 0,  # gathering k, v and the exchange
        held_fwd + k_fwd + (qkv_g if cuda and U > 1 else 0),  # the next group in flight
        og + 2 * og if U > 1 else 0,  # the output's exchange
    )
    group = max(
        temps + 2 * bwd_in if U > 1 else 0,  # the exchange in
        held_bwd + k_bwd,
        3 * grads_g if U > 1 else grads_g,  # the gradients' exchange home
    )
    # the output gradient's own copy (which becomes dq) beside the incoming one, then dq,
    # dk, dv and one group; without layer tiles the output gradient stands in place of
    # the output kept as o_proj's input, which is counted as kept
    dkv = 2 * T * K * a
    backward = max(2 * out, out + dkv + group) if tiled else max(out, dkv + group)
    return GroupedSets(
        kernel_saved=T * (Q + 2 * K) * a,
        group=qkv_g,
        exchange=2 * bwd_in if U > 1 else 0,
        forward=forward,
        backward=backward,
    )
