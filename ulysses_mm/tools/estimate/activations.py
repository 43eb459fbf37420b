"""What one rank's activations occupy: what a decoder layer saves for backward, and the
working sets that come on top of it at the moment each peaks.

Per decoder layer of :mod:`ulysses_mm.model.llama`: two RMSNorms (fp32 input, normalised
value, output: 4D + 2aD), attention (the kernel's q, k, v — under Ulysses the packed
[b, s, hq/P + 2e/P, d] buffer after the all-to-all —, its output and fp32 log-sum-exp,
the o_proj input: (3Q + 2E)·a + 4·hq) and the SwiGLU MLP (gate, silu, up, product:
4·F·a; none with MLP tiling). The sequence-tiled layer (``model.layer_tile_tokens``) keeps
its input, what the kernel saves and the kernel output; norms, projections and MLP exist
per tile only. ``sdpa_dense`` adds its [b, s, s] masks (O(s²) per rank whatever sp is),
``flex`` its block tables; SDPA without native GQA saves k, v expanded to the query heads.
Ring attention's own sets are in :mod:`ulysses_mm.tools.estimate.ring`, attention in
head groups (``parallel.head_chunks``) in :mod:`ulysses_mm.tools.estimate.head_chunks`.

Symbols: T = b·N/sp tokens of a rank, a = 2 bytes (bf16/fp16) or 4 (fp32), D hidden, F MLP
width, Q = hq·d, K = hk·d, E = e·d with e the kv heads replicated for Ulysses, V' the
widest head (specials + the largest modality vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.config import RunConfig
from ulysses_mm.tools.estimate.head_chunks import grouped_sets
from ulysses_mm.tools.estimate.ring import ring_working_sets
from ulysses_mm.tools.estimate.shape import ModelShape, StepShape

# torch's flex attention block (ulysses_mm.model.attention.FLEX_BLOCK)
FLEX_BLOCK = 128


def flex_block_mask_bytes(micro_batch: int, seq_len: int) -> int:
    """What flex attention's BlockMask holds (ulysses_mm.model.attention.DocumentMask
    .block_mask): kv and q block indices for partial and full blocks, int32
    [b, 1, nb, nb] each, and their int32 [b, 1, nb] counts (nb = s / 128, rounded up)."""
    nb = -(-seq_len // FLEX_BLOCK)
    return 4 * 4 * micro_batch * nb * (nb + 1)


@dataclass
class Activations:
    """One rank's activation figures (bytes) at T tokens."""

    tokens: int
    inputs: int  # the batch's fields on the device
    fixed: int  # the batch, document run ids, RoPE tables, the loss's per-token modality
    residual: int  # one [T, D] tensor of the residual stream
    norm: int  # what one RMSNorm saves
    attention_saved: int  # what attention saves (kernel inputs, output, lse, o_proj input)
    kernel_saved: int  # the same less the o_proj input
    after_all_to_all: int  # the kernel's q, k, v as it sees them
    all_to_all: int  # send + receive buffers of one exchange of q, k, v
    attention_forward: int  # forward working set beyond what attention saves
    attention_backward: int  # backward working set beyond attention's saved tensors
    mlp_saved: int
    mlp_tile_tokens: int  # 0: no MLP tiling
    mlp_forward: int  # forward working set of tiled MLP (one tile + the tiles' outputs)
    mlp_backward: int
    norm_backward: int
    loss_tile_tokens: int
    loss: int  # the loss backward's working set (tile + hidden-state gradient buffer)
    final_norm: int  # what the final norm keeps for backward (tiled: its input)
    final_norm_backward: int  # its backward's working set
    layer_tile_tokens: int = 0  # 0: no layer tiling
    tile_saved: int = 0  # tiled layer: what the layer keeps beyond its input
    tile_forward: int = 0  # tiled layer: the tiles' outputs and one tile's forward set
    tile_backward: int = 0  # tiled layer: one recomputed tile's backward set
    qkv: int = 0  # the caller's q, k, v [T, Q + 2K] (and their gradients)
    o: int = 0  # the kernel's output as the o_proj sees it [T, Q] (and its gradient)
    ring_scores: int = 0  # ring: one block's [b, hq/U, N/R, N/R] fp32 scores
    ring_forward: int = 0  # ring: the forward's working set (K/V blocks, block kernel)
    ring_backward: int = 0  # ring: the backward's (K/V blocks, dK/dV, block kernel)
    head_chunks: int = 1  # C: attention in C groups of heads (parallel.head_chunks)

    @property
    def layer(self) -> int:
        """What one layer saves without checkpointing."""
        return 2 * self.norm + self.attention_saved + self.mlp_saved


def activations(
    cfg: RunConfig, sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str
) -> Activations:
    """One rank's activations at ``a`` bytes per element under ``kernel`` (the attention
    kernel that runs, or ``ring`` / ``ring_flash``); ``cuda``: a GPU's batch layout and
    kernel scratch (the flash backward's fp32 dq accumulator, expanded GQA gradients)."""
    m = cfg.model
    P, T, S = step.sp, step.tokens, step.full_tokens
    U, R = step.ulysses, step.ring
    D, F, Q, K, d = sh.hidden, sh.inter, sh.q_width, sh.kv_width, sh.head_dim
    e = sh.kv_expanded(U)
    E = e * d
    # the batch (5 int64 fields: on CPU the SP slices are views of the whole sample, on a
    # GPU the slice is copied over and doc_ids stay whole), run ids (int32, whole), RoPE
    # cos/sin, the loss's per-token modality (int64)
    inputs = 40 * S if not cuda else 32 * T + 8 * S
    if R > 1 and not cuda:
        inputs += 32 * T  # the zigzag slice gathers its tokens: copies, not views
    fixed = inputs + 4 * S + 2 * T * d * a + 8 * T
    x = T * D * a
    norm = T * (4 * D + 2 * a * D + 4)
    kernel_saved = T * ((2 * Q + 2 * E) * a + 4 * sh.heads)
    # SDPA on a GPU without native GQA (fp32, or any explicit mask): k, v expanded to the
    # query heads and saved by the kernel. Without SP the unexpanded k, v are freed; under
    # SP they are views of the all-to-all's receive buffer, which q keeps alive.
    if cuda and sh.heads > e and (kernel == "sdpa_dense" or (kernel == "sdpa_varlen" and a == 4)):
        kernel_saved += 2 * T * Q * a - (2 * T * E * a if U == 1 else 0)
    if kernel == "flex":
        fixed += flex_block_mask_bytes(step.micro_batch, step.seq_len)
    if kernel == "sdpa_dense":
        # the [b, 1, s, s] boolean mask (once per step) and, saved by every layer's
        # kernel, the additive mask SDPA makes of it in the compute dtype: O(s²) per rank
        # whatever sp is
        fixed += step.micro_batch * step.seq_len**2
        kernel_saved += a * step.micro_batch * step.seq_len**2
    packed = T * (Q + 2 * E) * a
    C = step.head_chunks
    if U > 1 and C == 1:
        # the exchanges' send buffer: one workspace the size of the largest exchange (q, k,
        # v packed), kept for the whole run (ulysses_mm.parallel.comm.Workspace)
        fixed += packed
        # the caller's q, k, v, the replicated k, v, (for b > 1 the receive buffer: the
        # [b, P, n] -> [b, s] reshape then copies), and at the return exchange the kernel
        # output, its contiguous copy and the receive buffer
        rep = 2 * T * E * a if e > sh.kv_heads else 0
        recv = packed if step.micro_batch > 1 else 0
        attn_fwd = T * (Q + 2 * K) * a + rep + recv + 3 * T * Q * a
        # output-gradient exchange (2Q), kernel gradients (Q + 2E), q/k/v-gradient
        # exchange once the kernel's inputs are freed (4E net)
        attn_bwd = max(T * (Q + 2 * E) * a, 2 * T * Q * a, 4 * T * E * a)
    else:
        attn_fwd = 2 * T * Q * a  # the output concatenated per document, then per row
        attn_bwd = T * (Q + 2 * E) * a  # dq, dk, dv (the output gradient replaces o_in)
    ring_scores = ring_fwd = ring_bwd = 0
    if R > 1:
        ring_scores, ring_fwd, ring_bwd = ring_working_sets(sh, step, a, kernel == "ring_flash")
        kernel_saved = T * ((Q + 2 * E) * a + 4 * Q + 4 * sh.heads)
        # the ring's token indices (int64 [N/R] per ring rank) and document runs (int32
        # [b, N/R] per ring rank), made once per step
        fixed += 8 * step.seq_len + 4 * S
        # before the ring (U > 1): the caller's q, k, v, the replicated k, v, the receive
        # buffer's copy (b > 1): what the Ulysses forward holds while its kernel runs
        pre = T * (Q + 2 * K) * a + rep + recv if U > 1 else 0
        attn_fwd = max(attn_fwd if U > 1 else 0, pre + ring_fwd)
        attn_bwd = max(attn_bwd, ring_bwd)
    if cuda and kernel in ("flash_varlen", "sdpa_varlen"):
        attn_bwd += 4 * T * Q  # the flash backward's fp32 dq accumulator
        if sh.heads > e:
            attn_bwd += 2 * T * Q * a  # GQA: dk, dv expanded to the query heads
    lt = m.layer_tile_tokens * step.micro_batch
    layer_tiled = m.layer_tile_tokens > 0 and step.seq_len // P > m.layer_tile_tokens
    exchange = 2 * packed if U > 1 else 0
    if C > 1:  # in head groups: their own sets (the send buffers made per exchange)
        g = grouped_sets(sh, step, a, cuda, kernel, layer_tiled)
        kernel_saved, packed, exchange = g.kernel_saved, g.group, g.exchange
        attn_fwd, attn_bwd = g.forward, g.backward
    tiled = m.mlp_tile_tokens > 0 and step.seq_len // P > m.mlp_tile_tokens
    if tiled:
        mt = m.mlp_tile_tokens * step.micro_batch
        mlp_saved = 0
        mlp_fwd = 4 * mt * F * a + 2 * x  # one tile's set; the tiles' outputs and their cat
        mlp_bwd = 6 * mt * F * a + x  # a recomputed tile and its gradients; tile gradients
    else:
        mlp_saved = 4 * T * F * a
        mlp_fwd = 0
        # the gradients of the product, silu and up (less the product, freed); at the end
        # the gradient of gate and the input gradients through up and gate, the MLP's
        # saved set freed (their sum comes once the norm's output is freed)
        mlp_bwd = max(2 * T * F * a, 2 * x + T * F * a - mlp_saved)
    # RMSNorm's backward, beyond what the norm saves, its incoming gradient included (its
    # output is freed by then): the weight's and the input's gradient products, in fp32
    # with the casts for bf16/fp16
    norm_bwd = 16 * T * D if a != 4 else 2 * x
    # A recomputed loss tile saves hm [t, D] and log_softmax [t, V'] fp32; its backward
    # first adds the nll and log_softmax gradients (two more fp32 [t, V']), then the two
    # head matmuls' gradients of hm while the other modalities' (zero-filled [t, D])
    # gradients of the tile are summed.
    tile = min(m.loss_tile_tokens, T)
    Vw = sh.widest_head
    low = a if a != 4 else 0
    loss = tile * (max(2 * D * a + 12 * Vw, 4 * D * a + (4 + low) * Vw) + 24)
    if tile < T:  # the tiles' hidden-state gradients fill one buffer (offload.tiles)
        loss += x
    if P > 1:
        # the targets spread over the SP group (parallel.loss_balance): their gradients
        # travel home beside the rows' gradient buffer and the [T, D] they land in
        loss = max(loss, 3 * x)
    final_norm, final_norm_bwd = norm, norm_bwd
    tile_saved = tile_fwd = tile_bwd = 0
    if layer_tiled:
        # kept: the input (counted as the checkpoint), what the kernel saves and its
        # output as o_proj's input; the norms' and MLP's activations exist per tile only
        tile_saved = kernel_saved + T * Q * a
        # a tile's forward: norm (fp32), MLP (gate, up, silu, product), projections
        tile_fwd = lt * (4 * F * a + 8 * D + 2 * D * a)
        # a recomputed tile and its gradients: MLP and norm sets, their gradients
        tile_bwd = lt * (10 * F * a + 16 * D + 6 * D * a + (Q + 2 * K) * a)
        final_norm = x + x  # its input and its output (the loss's input)
        # the incoming gradient, the input-gradient buffer, one tile's set
        final_norm_bwd = 2 * x + lt * 16 * D
    return Activations(
        tokens=T,
        inputs=inputs,
        fixed=fixed,
        residual=x,
        norm=norm,
        attention_saved=kernel_saved + T * Q * a,
        kernel_saved=kernel_saved,
        after_all_to_all=packed,
        all_to_all=exchange,
        attention_forward=attn_fwd,
        attention_backward=attn_bwd,
        mlp_saved=mlp_saved,
        mlp_tile_tokens=mt if tiled else 0,
        mlp_forward=mlp_fwd,
        mlp_backward=mlp_bwd,
        norm_backward=norm_bwd,
        loss_tile_tokens=tile,
        loss=loss,
        final_norm=final_norm,
        final_norm_backward=final_norm_bwd,
        layer_tile_tokens=lt if layer_tiled else 0,
        tile_saved=tile_saved,
        tile_forward=tile_fwd,
        tile_backward=tile_bwd,
        qkv=T * (Q + 2 * K) * a,
        o=T * Q * a,
        ring_scores=ring_scores,
        ring_forward=ring_fwd,
        ring_backward=ring_bwd,
        head_chunks=C,
    )
