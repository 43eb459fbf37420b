"""The bytes one rank sends per layer, reported beside the memory: the all-to-all over
the U ranks of a Ulysses group and the ring's K/V blocks
(:func:`~ulysses_mm.parallel.ring.ring_theory_bytes`)."""

from __future__ import annotations

from ulysses_mm.tools.estimate.shape import ModelShape, StepShape


def sent_per_layer(sh: ModelShape, step: StepShape, a: int) -> dict[str, int]:
    """Bytes one rank sends per layer: the all-to-all (q, k, v in and the output back over
    the U ranks of a Ulysses group, on N/R tokens; the gradients the same way back, and
    with head groups q, k, v again for the recomputation:
    :func:`~ulysses_mm.parallel.head_groups.exchange_heads`) and the ring's K/V blocks
    (backward: again, with their fp32 dK/dV)."""
    from ulysses_mm.parallel.head_groups import exchange_heads  # lazy: imports torch
    from ulysses_mm.parallel.ring import ring_theory_bytes  # lazy: imports torch

    U, R, b = step.ulysses_size, step.ring_size, step.micro_batch
    fwd, bwd = exchange_heads(sh.heads, sh.kv_heads, U, step.head_groups)

    def a2a(heads: int) -> int:
        return (step.seq_len // R) * heads * sh.head_dim // U * (U - 1) // U * a * b

    ring_fwd, ring_bwd = ring_theory_bytes(
        step.seq_len, R, U, sh.heads, sh.kv_heads, sh.head_dim, b, elem_bytes=a
    )
    return {
        "all_to_all_forward": a2a(fwd),
        "all_to_all_backward": a2a(bwd),
        "ring_forward": ring_fwd,
        "ring_backward": ring_bwd,
    }
