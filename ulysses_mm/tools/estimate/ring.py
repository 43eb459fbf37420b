"""Ring attention's working sets on one rank (R > 1, in place of the local kernel).

It saves q, k, v, its fp32 output and log-sum-exp; its forward holds the K/V block and
the one in flight and, per block, the gathered rows and the block kernel's set; its
backward the two K/V blocks, the fp32 dK/dV and dq and the block kernel's gradients.
flash-attn's varlen calls keep no scores; the PyTorch block kernel is dense per piece of
one row's queries: three [hq/U, N/R, N/R] fp32 at once in forward, five in backward.
"""

from __future__ import annotations

from ulysses_mm.tools.estimate.shape import ModelShape, StepShape


def ring_working_sets(sh: ModelShape, step: StepShape, a: int, flash: bool) -> tuple[int, int, int]:
    """Ring attention's (:mod:`ulysses_mm.parallel.ring`) working sets on one rank, beyond
    what it saves (q, k, v, its fp32 output and log-sum-exp): (one piece's [h, nq, nk]
    fp32 scores, the forward's set, the backward's set beyond the output gradient).

    A ring rank holds N/R tokens on hq/U query heads and e/U kv heads: T·Q and T·E
    elements. Each block runs as at most two varlen calls over the rows it gathers (q, k,
    v copies); flash-attn's (``flash``) keep no scores, the PyTorch kernel is dense per
    piece of one row's queries (nq = nk ≤ N/R) and works in fp32."""
    T, U, b = step.tokens, step.ulysses_size, step.micro_batch
    Q = sh.q_width
    E = sh.kv_expanded(U) * sh.head_dim
    n = step.seq_len // step.ring_size
    kv = 2 * T * E * a  # torch.stack([k, v]): one K/V block
    gathered = T * (Q + 2 * E) * a  # a call's q, k, v rows
    if flash:
        # forward: the block at work and the next in flight, the gathered rows, the call's
        # output (compute dtype) and its fp32 copy, the block's fp32 output the merge reads
        # and the merged one it writes
        fwd = 2 * kv + gathered + T * Q * a + 3 * 4 * T * Q
        # backward: the block and the next, the fp32 dK/dV accumulator and the one in
        # flight, fp32 dq; a call's gathered dout, q, k, v, out (fp32 and compute dtype),
        # its dq, dk, dv, their fp32 copies and flash's fp32 dq accumulator
        bwd = (
            2 * kv
            + 16 * T * E
            + 4 * T * Q
            + gathered
            + 2 * T * Q * a
            + 4 * T * Q
            + gathered
            + 4 * T * (Q + 2 * E)
            + 4 * T * Q
        )
        return 0, fwd, bwd
    scores = 4 * (sh.heads // U) * n * n  # one piece's [hq/U, N/R, N/R] fp32
    mask = n * n  # the piece's [nq, nk] boolean: same segment, not in the future
    low = a != 4  # the kernel's fp32 copies of bf16/fp16 inputs
    expand = 8 * T * Q // b if sh.heads > sh.kv_expanded(U) else 0  # GQA: k, v repeated
    # forward: the block at work and the next in flight, the gathered rows, their fp32
    # copies, the expanded k, v, the mask (and its negation), three [h, nq, nk] at once
    # (the scores, then the log-sum-exp's shifted copy and its exponential, then the
    # probabilities) and the block's fp32 output before the merge
    fwd = (
        2 * kv
        + gathered
        + (4 * T * (Q + 2 * E) // b if low else 0)
        + expand
        + 2 * mask
        + 3 * scores
        + 4 * T * Q
    )
    # backward: fp32 dout and q, delta, the block and the next in flight, the fp32 dK/dV
    # accumulator and dq, the gathered rows, fp32 k, v, the expanded k, v, the mask, the
    # block's dv at the query heads, the previous block's dq, dk, dv (still bound while
    # the next one runs), and five [h, nq, nk] at once (scores, probabilities, dp,
    # dp − delta, ds)
    bwd = (
        (8 * T * Q if low else 0)
        + 4 * T * sh.heads
        + 2 * kv
        + 8 * T * E
        + 4 * T * Q
        + gathered
        + (8 * T * E if low else 0)
        + expand
        + mask
        + 4 * T * Q
        + 4 * T * Q
        + 8 * T * E
        + 5 * scores
    )
    return scores, fwd, bwd
