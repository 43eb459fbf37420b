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
head groups (``parallel.head_groups``) in :mod:`ulysses_mm.tools.estimate.head_groups`.

Symbols: T = b·N/sp tokens of a rank, a = 2 bytes (bf16/fp16) or 4 (fp32), D hidden, F MLP
width, Q = hq·d, K = hk·d, E = e·d with e the kv heads replicated for Ulysses, V' the
widest head (specials + the largest modality vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ulysses_mm.config import RunConfig
from ulysses_mm.tools.estimate.head_groups import grouped_sets
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
    head_groups: int = 1  # C: attention in C groups of heads (parallel.head_groups)

    @property
    def layer(self) -> int:
        """What one layer saves without checkpointing."""
        return 2 * self.norm + self.attention_saved + self.mlp_saved


@dataclass(frozen=True)
class _Attention:
    """Attention's figures on one rank (bytes); see :class:`Activations`."""

    kernel_saved: int
    after_all_to_all: int
    all_to_all: int
    forward: int
    backward: int
    fixed: int  # what it adds to the step's fixed tensors (masks, buffers, indices)
    ring_scores: int = 0
    ring_forward: int = 0
    ring_backward: int = 0


def batch_inputs(step: StepShape, cuda: bool) -> int:
    """The batch's 5 int64 fields: on CPU the SP slices are views of the whole sample, on a
    GPU the slice is copied over and doc_ids stay whole."""
    T, S = step.tokens, step.full_tokens
    inputs = 40 * S if not cuda else 32 * T + 8 * S
    if step.ring_size > 1 and not cuda:
        inputs += 32 * T  # the zigzag slice gathers its tokens: copies, not views
    return inputs


def fixed_tensors(sh: ModelShape, step: StepShape, a: int, inputs: int) -> int:
    """The batch, its run ids (int32, whole), RoPE cos/sin and the loss's per-token
    modality (int64): alive for the whole step."""
    T, S = step.tokens, step.full_tokens
    return inputs + 4 * S + 2 * T * sh.head_dim * a + 8 * T


def local_kernel(
    sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str
) -> tuple[int, int]:
    """(what the local attention kernel saves, what it adds to the fixed tensors)."""
    T, U = step.tokens, step.ulysses_size
    Q, E = sh.q_width, sh.kv_expanded(U) * sh.head_dim
    saved = T * ((2 * Q + 2 * E) * a + 4 * sh.heads)
    fixed = 0
    # SDPA on a GPU without native GQA (fp32, or any explicit mask): k, v expanded to the
    # query heads and saved by the kernel. Without SP the unexpanded k, v are freed; under
    # SP they are views of the all-to-all's receive buffer, which q keeps alive.
    gqa = cuda and sh.heads > sh.kv_expanded(U)
    if gqa and (kernel == "sdpa_dense" or (kernel == "sdpa_varlen" and a == 4)):
        saved += 2 * T * Q * a - (2 * T * E * a if U == 1 else 0)
    if kernel == "flex":
        fixed += flex_block_mask_bytes(step.micro_batch, step.seq_len)
    if kernel == "sdpa_dense":
        # the [b, 1, s, s] boolean mask (once per step) and, saved by every layer's
        # kernel, the additive mask SDPA makes of it in the compute dtype: O(s²) per rank
        # whatever sp is
        fixed += step.micro_batch * step.seq_len**2
        saved += a * step.micro_batch * step.seq_len**2
    return saved, fixed


def _ulysses_held(sh: ModelShape, step: StepShape, a: int) -> int:
    """What the Ulysses forward holds while its kernel runs: the caller's q, k, v, the
    replicated k, v, and (for b > 1) the receive buffer's copy (the [b, P, n] -> [b, s]
    reshape copies)."""
    T, U = step.tokens, step.ulysses_size
    Q, K, E = sh.q_width, sh.kv_width, sh.kv_expanded(U) * sh.head_dim
    rep = 2 * T * E * a if sh.kv_expanded(U) > sh.kv_heads else 0
    recv = T * (Q + 2 * E) * a if step.micro_batch > 1 else 0
    return T * (Q + 2 * K) * a + rep + recv


def exchange_sets(sh: ModelShape, step: StepShape, a: int) -> tuple[int, int, int]:
    """(forward, backward working sets, send workspace) of attention with all heads at
    once: under Ulysses (U > 1) around the all-to-alls, else around the local kernel."""
    T, U = step.tokens, step.ulysses_size
    Q, E = sh.q_width, sh.kv_expanded(U) * sh.head_dim
    packed = T * (Q + 2 * E) * a
    if U > 1 and step.head_groups == 1:
        # the send buffer: one workspace the size of the largest exchange (q, k, v
        # packed), kept for the whole run (ulysses_mm.parallel.comm.Workspace); at the
        # return exchange the kernel output, its contiguous copy and the receive buffer
        forward = _ulysses_held(sh, step, a) + 3 * T * Q * a
        # output-gradient exchange (2Q), kernel gradients (Q + 2E), q/k/v-gradient
        # exchange once the kernel's inputs are freed (4E net)
        backward = max(T * (Q + 2 * E) * a, 2 * T * Q * a, 4 * T * E * a)
        return forward, backward, packed
    # the output concatenated per document, then per row; dq, dk, dv (the output gradient
    # replaces o_in)
    return 2 * T * Q * a, T * (Q + 2 * E) * a, 0


def ring_sets(
    sh: ModelShape, step: StepShape, a: int, kernel: str, forward: int, backward: int
) -> _Attention:
    """Ring attention (R > 1) in place of the local kernel, around the ``forward`` and
    ``backward`` sets of the exchanges (U > 1)."""
    T, U, S = step.tokens, step.ulysses_size, step.full_tokens
    Q, E = sh.q_width, sh.kv_expanded(U) * sh.head_dim
    scores, ring_fwd, ring_bwd = ring_working_sets(sh, step, a, kernel == "ring_flash")
    pre = _ulysses_held(sh, step, a) if U > 1 else 0
    return _Attention(
        kernel_saved=T * ((Q + 2 * E) * a + 4 * Q + 4 * sh.heads),
        after_all_to_all=T * (Q + 2 * E) * a,
        all_to_all=0,
        forward=max(forward if U > 1 else 0, pre + ring_fwd),
        backward=max(backward, ring_bwd),
        # the ring's token indices (int64 [N/R] per ring rank) and document runs (int32
        # [b, N/R] per ring rank), made once per step
        fixed=8 * step.seq_len + 4 * S,
        ring_scores=scores,
        ring_forward=ring_fwd,
        ring_backward=ring_bwd,
    )


def kernel_scratch(sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str) -> int:
    """The flash backward's scratch on a GPU: its fp32 dq accumulator and, under GQA, dk,
    dv expanded to the query heads."""
    if not (cuda and kernel in ("flash_varlen", "sdpa_varlen")):
        return 0
    T, Q = step.tokens, sh.q_width
    return 4 * T * Q + (2 * T * Q * a if sh.heads > sh.kv_expanded(step.ulysses_size) else 0)


def attention(
    sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str, layer_tiled: bool
) -> _Attention:
    """Attention's saved set and working sets: the local kernel, the Ulysses exchanges,
    ring attention (R > 1), the flash scratch, or head groups (C > 1) in their place."""
    T, U = step.tokens, step.ulysses_size
    Q, E = sh.q_width, sh.kv_expanded(U) * sh.head_dim
    saved, fixed = local_kernel(sh, step, a, cuda, kernel)
    forward, backward, workspace = exchange_sets(sh, step, a)
    at = _Attention(saved, T * (Q + 2 * E) * a, 0, forward, backward, fixed + workspace)
    if step.ring_size > 1:
        ring = ring_sets(sh, step, a, kernel, forward, backward)
        at = replace(ring, fixed=at.fixed + ring.fixed)
    at = replace(
        at,
        backward=at.backward + kernel_scratch(sh, step, a, cuda, kernel),
        all_to_all=2 * at.after_all_to_all if U > 1 else 0,
    )
    if step.head_groups > 1:  # in head groups: their own sets (send buffers per exchange)
        g = grouped_sets(sh, step, a, cuda, kernel, layer_tiled)
        at = replace(
            at,
            kernel_saved=g.kernel_saved,
            after_all_to_all=g.group,
            all_to_all=g.exchange,
            forward=g.forward,
            backward=g.backward,
        )
    return at


def mlp(cfg: RunConfig, sh: ModelShape, step: StepShape, a: int) -> tuple[int, int, int, int]:
    """The SwiGLU MLP: (tile tokens, 0 untiled; saved; forward and backward working sets)."""
    m, T, F = cfg.model, step.tokens, sh.inter
    x = T * sh.hidden * a
    if m.mlp_tile_tokens > 0 and step.seq_len // step.sp > m.mlp_tile_tokens:
        mt = m.mlp_tile_tokens * step.micro_batch
        # one tile's set, the tiles' outputs and their cat; a recomputed tile and its
        # gradients, the tile gradients
        return mt, 0, 4 * mt * F * a + 2 * x, 6 * mt * F * a + x
    saved = 4 * T * F * a
    # the gradients of the product, silu and up (less the product, freed); at the end
    # the gradient of gate and the input gradients through up and gate, the MLP's
    # saved set freed (their sum comes once the norm's output is freed)
    return 0, saved, 0, max(2 * T * F * a, 2 * x + T * F * a - saved)


def norm(sh: ModelShape, step: StepShape, a: int) -> tuple[int, int]:
    """One RMSNorm: (what it saves, its backward's working set). The backward, beyond what
    the norm saves, its incoming gradient included (its output is freed by then): the
    weight's and the input's gradient products, in fp32 with the casts for bf16/fp16."""
    T, D = step.tokens, sh.hidden
    return T * (4 * D + 2 * a * D + 4), (16 * T * D if a != 4 else 2 * T * D * a)


def loss(cfg: RunConfig, sh: ModelShape, step: StepShape, a: int) -> tuple[int, int]:
    """(loss tile tokens, the loss backward's working set).

    A recomputed loss tile saves hm [t, D] and log_softmax [t, V'] fp32; its backward
    first adds the nll and log_softmax gradients (two more fp32 [t, V']), then the two
    head matmuls' gradients of hm while the other modalities' (zero-filled [t, D])
    gradients of the tile are summed."""
    T, D = step.tokens, sh.hidden
    x = T * D * a
    tile = min(cfg.model.loss_tile_tokens, T)
    Vw = sh.widest_head
    low = a if a != 4 else 0
    out = tile * (max(2 * D * a + 12 * Vw, 4 * D * a + (4 + low) * Vw) + 24)
    if tile < T:  # the tiles' hidden-state gradients fill one buffer (offload.tiles)
        out += x
    if step.sp > 1:
        # the targets spread over the SP group (parallel.loss_balance): their gradients
        # travel home beside the rows' gradient buffer and the [T, D] they land in
        out = max(out, 3 * x)
    return tile, out


def layer_tile(
    sh: ModelShape, step: StepShape, a: int, lt: int, kernel_saved: int
) -> tuple[int, int, int, int, int]:
    """A sequence-tiled layer of ``lt`` tokens a tile: (what it keeps beyond its input,
    one tile's forward and backward sets, the final norm's saved set and backward set).

    It keeps its input (counted as the checkpoint), what the kernel saves and the kernel's
    output as o_proj's input; the norms' and MLP's activations exist per tile only."""
    T, D, F, Q, K = step.tokens, sh.hidden, sh.inter, sh.q_width, sh.kv_width
    x = T * D * a
    saved = kernel_saved + T * Q * a
    # a tile's forward: norm (fp32), MLP (gate, up, silu, product), projections
    forward = lt * (4 * F * a + 8 * D + 2 * D * a)
    # a recomputed tile and its gradients: MLP and norm sets, their gradients
    backward = lt * (10 * F * a + 16 * D + 6 * D * a + (Q + 2 * K) * a)
    # the final norm keeps its input and its output (the loss's input); its backward the
    # incoming gradient, the input-gradient buffer, one tile's set
    return saved, forward, backward, x + x, 2 * x + lt * 16 * D


def activations(
    cfg: RunConfig, sh: ModelShape, step: StepShape, a: int, cuda: bool, kernel: str
) -> Activations:
    """One rank's activations at ``a`` bytes per element under ``kernel`` (the attention
    kernel that runs, or ``ring`` / ``ring_flash``); ``cuda``: a GPU's batch layout and
    kernel scratch (the flash backward's fp32 dq accumulator, expanded GQA gradients)."""
    m, T = cfg.model, step.tokens
    inputs = batch_inputs(step, cuda)
    layer_tiled = m.layer_tile_tokens > 0 and step.seq_len // step.sp > m.layer_tile_tokens
    at = attention(sh, step, a, cuda, kernel, layer_tiled)
    mt, mlp_saved, mlp_fwd, mlp_bwd = mlp(cfg, sh, step, a)
    norm_saved, norm_bwd = norm(sh, step, a)
    loss_tile, loss_bwd = loss(cfg, sh, step, a)
    lt = m.layer_tile_tokens * step.micro_batch if layer_tiled else 0
    tile_saved = tile_fwd = tile_bwd = 0
    final_norm, final_norm_bwd = norm_saved, norm_bwd
    if layer_tiled:
        tile_saved, tile_fwd, tile_bwd, final_norm, final_norm_bwd = layer_tile(
            sh, step, a, lt, at.kernel_saved
        )
    return Activations(
        tokens=T,
        inputs=inputs,
        fixed=fixed_tensors(sh, step, a, inputs) + at.fixed,
        residual=T * sh.hidden * a,
        norm=norm_saved,
        attention_saved=at.kernel_saved + T * sh.q_width * a,
        kernel_saved=at.kernel_saved,
        after_all_to_all=at.after_all_to_all,
        all_to_all=at.all_to_all,
        attention_forward=at.forward,
        attention_backward=at.backward,
        mlp_saved=mlp_saved,
        mlp_tile_tokens=mt,
        mlp_forward=mlp_fwd,
        mlp_backward=mlp_bwd,
        norm_backward=norm_bwd,
        loss_tile_tokens=loss_tile,
        loss=loss_bwd,
        final_norm=final_norm,
        final_norm_backward=final_norm_bwd,
        layer_tile_tokens=lt,
        tile_saved=tile_saved,
        tile_forward=tile_fwd,
        tile_backward=tile_bwd,
        qkv=T * (sh.q_width + 2 * sh.kv_width) * a,
        o=T * sh.q_width * a,
        ring_scores=at.ring_scores,
        ring_forward=at.ring_forward,
        ring_backward=at.ring_backward,
        head_groups=step.head_groups,
    )
