"""``ulysses-mm estimate``: per-GPU memory of a training run, from its config alone.

Arithmetic over the run config, the token space and the world layout (nothing is built or
run): what each tensor of THIS implementation occupies on one rank at each phase of a
training step, and the peak over the phases. It answers "does N tokens fit on G GPUs of
M GB" and, by bisection over N, "what is the longest sequence that fits".

World: ``gpus`` ranks = dp × sp. A rank holds n = N/sp tokens of each of its
``data.micro_batch_size`` = b samples (T = b·n below). DeepSpeed partitions ZeRO state over
all dp × sp ranks (the sequence-data-parallel group): a partition is 1/W for W = gpus.
With a ring (``parallel.ring`` = R, sp = U × R) the all-to-all runs over U = sp / R ranks
and ring attention (:mod:`ulysses_mm.parallel.ring`) across the R groups: outside attention
a rank still holds N/sp tokens; inside it, N/R tokens on hq/U query heads (the same T·Q
elements) and kv heads replicated for U.

Symbols: a = 2 bytes (bf16/fp16) or 4 (fp32) per activation and parameter; D hidden,
F MLP width, Q = hq·d query width, K = hk·d key/value width, E = e·d with e = lcm(hk, sp)
(Ulysses replicates kv heads so they split over sp), V' = specials + the largest modality
vocabulary (the widest head).

What is counted, per rank:

- Parameters, gradients and optimizer states as DeepSpeed lays them out: ZeRO-0 (torch
  AdamW; for bf16/fp16 DeepSpeed's FP16_UnfusedOptimizer with an fp32 master copy),
  ZeRO-1/2 (flat low-precision parameters, fp32 master and Adam m, v partitioned, the
  gradient bucket(s) and for stage 2 the gradient partition), ZeRO-3 (a flat partition of
  everything, small tensors kept whole, the gradient partition and reduce bucket, the
  parameters gathered in forward and backward). Offload moves optimizer states (and ZeRO-3
  parameters) to the host. Gradients are reduced in fp32 under sequence parallelism
  (DeepSpeed's ``seq_parallel_communication_data_type``): ZeRO-0/1/2 convert a bf16 bucket
  to an fp32 copy while reducing it, ZeRO-3's reduce bucket is fp32 throughout.
- Activations saved for backward, per decoder layer of :mod:`ulysses_mm.model.llama`:
  two RMSNorms (fp32 input, normalised value, output: 4D + 2aD), attention (the kernel's
  q, k, v — under Ulysses the packed [b, s, hq/P + 2e/P, d] buffer after the all-to-all —,
  its output and fp32 log-sum-exp, the o_proj input: (3Q + 2E)·a + 4·hq) and the SwiGLU MLP
  (gate, silu, up, product: 4·F·a; none with MLP tiling). With activation checkpointing a
  layer keeps only its input (D·a) and one layer is recomputed at a time in backward.
  ``model.offload_checkpoints`` keeps those inputs in host memory (counted as host, apart
  from the device peak): on the device only the recomputed layer's input and the one
  prefetched for the layer before it (without the option the same figure is shown as a
  what-if). ``model.layer_tile_tokens`` (the sequence-tiled layer) keeps per layer its
  input, what the kernel saves and the kernel output (o_proj's input); norms, projections
  and MLP exist per tile only, and backward holds one-[T, D] gradient buffers per input
  (the input's, the kernel output's) plus one recomputed tile; the final norm is tiled too. The ``sdpa_dense`` kernel adds its [b, s, s] boolean
  mask and, per layer, the additive mask SDPA saves: O(s²) per rank whatever sp is. The
  ``flex`` kernel adds its block mask: four int32 [b, s/128, s/128] block tables
  (partial and full blocks, by query and by key block), built from the document spans.
  SDPA on a GPU takes GQA natively only in its flash backend (fp16/bf16, no explicit
  mask); in fp32, and always for ``sdpa_dense``, the kernel expands k, v to the query
  heads and saves them: 2·Q·a per token more.
- Ring attention (R > 1), in place of the local kernel: it saves q, k, v, its fp32 output
  and log-sum-exp; its forward holds the K/V block and the one in flight and, per block,
  the mask and three [b, hq/U, N/R, N/R] fp32 at once (its CPU/PyTorch block kernel is
  dense per block); its backward the two K/V blocks, the fp32 dK/dV and dq, the previous
  block's gradients and five of those [b, hq/U, N/R, N/R]. The bytes one rank sends per
  layer (all-to-all, and the ring's :func:`~ulysses_mm.parallel.ring.ring_theory_bytes`)
  are reported beside the memory.
- Working sets on top, each at the moment it peaks: the attention forward (the caller's
  q, k, v, the replicated k, v, the all-to-all send/receive buffers, the output exchange)
  and backward (kernel gradients, the exchanged gradients, on a GPU the flash kernel's fp32
  dq accumulator), the MLP backward (or one recomputed MLP tile), RMSNorm's fp32 backward,
  the recomputed loss tile ([tile, V'] fp32 log-softmax and two gradients of it, every tile
  token assumed to go through the widest head), the gradient of the hidden states summed
  over tiles, DeepSpeed's flattened all-reduce (ZeRO-0) and the optimizer step (torch AdamW
  on CUDA runs foreach: one fp32 copy of the states it updates; on CPU single-tensor: two of
  its largest tensor).
- On a GPU: allocator headroom (fragmentation of the caching allocator, a fraction of the
  tensor peak) and a runtime reserve, device memory that is not tensors: the CUDA context
  and cuBLAS workspaces (``CONTEXT_RESERVE_GIB``) plus NCCL's buffers for every
  communicator this rank is in — the world group and the SP and DP groups of more than
  one rank — at ``NCCL_GIB_PER_COMMUNICATOR`` each (0.5–1.6 GB per communicator on NVLink
  nodes, more with NVLS; an option). A flat ``reserve_gib`` replaces the whole figure.

The tensor peak is what ``torch.cuda.max_memory_allocated`` reports on a GPU and what
:class:`ulysses_mm.tools.memory.TensorMemoryTracker` counts on CPU. ``device="cpu"`` estimates
the latter (CPU optimizer path, batch layout and gloo collectives; no headroom, reserve or
kernel scratch): that is how the model is checked against measurement
(:mod:`ulysses_mm.tools.measure`, ``tests/test_estimate.py``). GPU-only terms (flash backward
scratch, foreach AdamW, headroom, reserve) are not checked here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.layout import check_layout, expanded_kv_heads
from ulysses_mm.core.tokenspace import TokenSpace

GiB = 1 << 30

# DeepSpeed's defaults for the zero_optimization keys read here
# (deepspeed.runtime.zero.config.DeepSpeedZeroConfig; a test checks them against it).
DS_ZERO_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "overlap_comm": None,  # None: True for stage 3, else False
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
}
# deepspeed.runtime.engine MEMORY_OPT_ALLREDUCE_SIZE: ZeRO-0 all-reduces gradients in
# flattened buckets of up to this many elements.
DS_ALLREDUCE_BUCKET = 500_000_000
# A sequence length searched by --max is a multiple of sp × this.
MAX_GRANULARITY = 1024
# Runtime reserve on a GPU (device memory that is not tensors): the CUDA context with its
# kernels and cuBLAS/cuDNN workspaces ...
CONTEXT_RESERVE_GIB = 1.0
# ... and NCCL's buffers per communicator (channels × peers × NCCL_BUFFSIZE, plus NVLS
# buffers on NVSwitch nodes): reported at 0.5–1.6 GB each on NVLink nodes; the low end by
# default, ``--nccl-reserve`` to change it.
NCCL_GIB_PER_COMMUNICATOR = 0.5
# torch's flex attention block (ulysses_mm.model.attention.FLEX_BLOCK)
FLEX_BLOCK = 128


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelShape:
    """Dimensions and parameter counts of :class:`ulysses_mm.model.MultimodalLM`."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    specials: int
    vocab: int  # the whole token space: embedding rows, and all heads' rows together
    widest_head: int  # specials + the largest modality vocabulary
    qk_norm: bool = False  # q/k RMSNorm weights, head_dim each (Qwen3)
    attention_bias: bool = False  # q/k/v biases (Qwen2)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_expanded(self, ulysses: int) -> int:
        """kv heads after Ulysses replication over ``ulysses`` ranks (see parallel.ulysses)."""
        return expanded_kv_heads(self.heads, self.kv_heads, ulysses)

    def _layer_tensors(self) -> list[int]:
        d, q, k, i = self.hidden, self.q_width, self.kv_width, self.inter
        extra = [self.head_dim, self.head_dim] if self.qk_norm else []
        extra += [q, k, k] if self.attention_bias else []
        return [d * q, d * k, d * k, q * d, d * i, d * i, i * d, d, d, *extra]

    @property
    def layer_params(self) -> int:
        return sum(self._layer_tensors())

    @property
    def head_params(self) -> int:
        """Every modality head + the shared specials head + the final norm."""
        return self.vocab * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.vocab * self.hidden + self.layers * self.layer_params + self.head_params

    @property
    def largest_param(self) -> int:
        return max([self.vocab * self.hidden, *self._layer_tensors()])

    def small_params(self, threshold: int, modality_sizes: list[int]) -> int:
        """Parameters in tensors of at most ``threshold`` elements (ZeRO-3 keeps those
        whole on every rank: stage3_param_persistence_threshold)."""
        sizes = [self.vocab * self.hidden, self.hidden, self.specials * self.hidden]
        sizes += [v * self.hidden for v in modality_sizes]
        small = sum(s for s in sizes if s <= threshold)
        return small + self.layers * sum(s for s in self._layer_tensors() if s <= threshold)


def model_shape(cfg: RunConfig, space: TokenSpace) -> ModelShape:
    m = cfg.model
    assert m.head_dim is not None
    return ModelShape(
        hidden=m.hidden_size,
        inter=m.intermediate_size,
        layers=m.num_hidden_layers,
        heads=m.num_attention_heads,
        kv_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        specials=space.num_specials,
        vocab=space.vocab_size,
        widest_head=space.num_specials + max(r.size for r in space.ranges),
        qk_norm=m.qk_norm,
        attention_bias=m.attention_bias,
    )


def token_space(cfg: RunConfig, manifest: str | None = None) -> tuple[TokenSpace, str]:
    """The token space the run trains on and where it comes from: ``model.modalities``,
    else the manifest given, else the shipped tokenizer specs' space."""
    if cfg.model.modalities:
        return TokenSpace.from_vocab(cfg.model.modalities), "model.modalities"
    if manifest:
        from ulysses_mm.shards.manifest import Manifest

        return Manifest.load(manifest, cfg.data.storage_options).token_space, manifest
    from ulysses_mm.core.tokenspace import DEFAULT_MODALITIES

    return TokenSpace.from_vocab(DEFAULT_MODALITIES), "the shipped tokenizer specs"


@dataclass(frozen=True)
class Layout:
    """The world an estimate is for."""

    gpus: int
    sp: int
    seq_len: int
    micro_batch: int
    ring: int = 1  # R: sp = U × R, Ulysses over U ranks, ring attention across R groups

    @property
    def dp(self) -> int:
        return self.gpus // self.sp

    @property
    def ulysses(self) -> int:
        """U = sp / R: the ranks of one all-to-all."""
        return self.sp // self.ring

    @property
    def tokens(self) -> int:
        """T: the tokens one rank holds outside attention, b · N/sp."""
        return self.micro_batch * (self.seq_len // self.sp)

    @property
    def full_tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def communicators(self) -> int:
        """NCCL communicators one rank is in: the world and its SP and DP groups, each
        when it has more than one rank, and with a ring its Ulysses group (U > 1) and its
        ring (ulysses_mm.parallel.Mesh.build)."""
        groups = [self.gpus, self.sp, self.dp]
        if self.ring > 1:
            groups += [self.ulysses, self.ring]
        return sum(n > 1 for n in groups)


def flex_block_mask_bytes(micro_batch: int, seq_len: int) -> int:
    """What flex attention's BlockMask holds (ulysses_mm.model.attention.DocumentMask
    .block_mask): kv and q block indices for partial and full blocks, int32
    [b, 1, nb, nb] each, and their int32 [b, 1, nb] counts (nb = s / 128, rounded up)."""
    nb = -(-seq_len // FLEX_BLOCK)
    return 4 * 4 * micro_batch * nb * (nb + 1)


def layout_for(cfg: RunConfig, seq_len: int, gpus: int | None, sp: int | None) -> Layout:
    """``gpus`` defaults to parallel.sp × parallel.dp; ``sp`` to ``gpus`` when gpus is
    given (the longest context puts every GPU in one sequence-parallel group), else to
    parallel.sp. The ring is parallel.ring (sp = U × R). Shapes Ulysses × ring cannot run
    are refused with what would work."""
    p = cfg.parallel
    if gpus is None:
        sp = sp or p.sp
        gpus = sp * (p.dp or 1)
    elif sp is None:
        sp = gpus
    if gpus < 1:
        raise ValueError(f"need at least one GPU, got {gpus}")
    m = cfg.model
    check_layout(
        sp,
        world=gpus,
        num_heads=m.num_attention_heads,
        num_kv_heads=m.num_key_value_heads,
        seq_len=seq_len,
        ring=p.ring,
    )
    return Layout(
        gpus=gpus, sp=sp, seq_len=seq_len, micro_batch=cfg.data.micro_batch_size, ring=p.ring
    )


# --------------------------------------------------------------------------- DeepSpeed


def _zero_settings(cfg: RunConfig, W: int, sp: int) -> dict[str, Any]:
    """The zero_optimization keys read here, as the engine's ds_config sets them for a
    world of ``W`` ranks in SP groups of ``sp`` (with ``deepspeed.extra`` merged), else
    DeepSpeed's defaults."""
    from ulysses_mm.parallel.mesh import Mesh
    from ulysses_mm.train.engine import ds_config

    zero = ds_config(cfg, Mesh(dp=W // sp, sp=sp, rank=0)).get("zero_optimization", {})
    out = {k: zero.get(k, v) for k, v in DS_ZERO_DEFAULTS.items()}
    if out["overlap_comm"] is None:
        out["overlap_comm"] = cfg.deepspeed.zero_stage == 3
    return out


def _comm_bytes(cfg: RunConfig, sp: int, a: int) -> int:
    """Element size of DeepSpeed's gradient communication: under sequence parallelism
    ``seq_parallel_communication_data_type`` (default fp32), else
    ``communication_data_type`` (default: the training precision)."""
    key = "seq_parallel_communication_data_type" if sp > 1 else "communication_data_type"
    value = str(cfg.deepspeed.extra.get(key, "fp32" if sp > 1 else ""))
    return {"fp32": 4, "fp16": 2, "bf16": 2}.get(value, a)


@dataclass
class ZeroStates:
    """Bytes one rank keeps for the parameters, by when they exist."""

    params: int  # the model's parameters on the device
    optimizer: int  # fp32 master copy + Adam m, v on the device
    host: int  # what offload keeps in host memory
    persistent: int  # DeepSpeed buffers alive across steps (ZeRO-3's reduce bucket)
    grad_partition: int  # ZeRO-3's gradient partition, alive across steps
    grad_backward: int  # ZeRO-2's gradient partition (from the first reduction on)
    backward: int  # buffers held through backward: the gradient bucket(s)
    gathered: int  # ZeRO-3 parameters gathered in forward and backward
    grad_head: int  # gradients held once the heads' backward is done (ZeRO-0/1)
    grad_layer: int  # ... and per decoder layer done
    grads_full: int  # every gradient (ZeRO-0/1 at the end of backward)
    reduce: int  # a gradient reduction's extra: ZeRO-0's flattened all-reduce bucket (+
    # its communication-dtype copy); ZeRO-1/2's communication-dtype copy of a bucket
    step_grads: int  # gradients during the optimizer step
    step_temp: int  # the optimizer step's temporaries
    notes: dict[str, str]


def zero_states(
    cfg: RunConfig, sh: ModelShape, space: TokenSpace, a: int, W: int, sp: int, cuda: bool
) -> ZeroStates:
    ds = cfg.deepspeed
    stage = ds.zero_stage
    psi = sh.params
    psi_r = -(-psi // W)  # one rank's partition
    z = _zero_settings(cfg, W, sp)
    rbs = int(z["reduce_bucket_size"])
    comm = _comm_bytes(cfg, sp, a)
    convert = comm if comm != a else 0  # a bucket's copy in the communication dtype
    master = "fp32 master + Adam m, v" if (a != 4 or stage > 0) else "Adam m, v"
    if stage == 0:
        # torch AdamW (fp32), or FP16_UnfusedOptimizer: an fp32 master copy per parameter;
        # its step converts every gradient to fp32 beside the low-precision one
        n = min(psi, DS_ALLREDUCE_BUCKET)
        return ZeroStates(
            params=a * psi,
            optimizer=((4 if a != 4 else 0) + 8) * psi,
            host=0,
            persistent=0,
            grad_partition=0,
            grad_backward=0,
            backward=0,
            gathered=0,
            grad_head=a * sh.head_params,
            grad_layer=a * sh.layer_params,
            grads_full=a * psi,
            reduce=(a + convert) * n,
            step_grads=a * psi + (4 * psi if a != 4 else 0),
            step_temp=4 * psi if cuda else 8 * sh.largest_param,
            notes={
                "params": "ZeRO-0: whole on every rank",
                "optimizer": master,
                "buffers": f"all-reduce of flattened gradients, {n:,} elements"
                + (" (+ fp32 copy)" if convert else ""),
            },
        )
    overlap = bool(z["overlap_comm"])
    bucket = a * rbs * (2 if overlap else 1) if z["contiguous_gradients"] else 0
    bucket_convert = convert * min(rbs, psi)
    host = persistent = gathered = grad_head = grad_layer = grads_full = 0
    grad_partition = grad_backward = 0
    if stage == 3:
        # the flat partition of every parameter, plus small tensors kept whole
        persist = 0
        if W > 1:  # (one rank's partition is the whole model)
            persist = sh.small_params(
                int(z["stage3_param_persistence_threshold"]), [r.size for r in space.ranges]
            )
        params = a * (psi_r + persist)
        if ds.offload_param != "none":
            host += a * psi_r
            params = a * persist
        grad_partition = a * psi_r
        persistent = comm * rbs  # one reduce bucket, in the communication dtype
        if W > 1:
            # Gathered parameters stay gathered while their reuse distance is short, up to
            # stage3_max_live_parameters (with the defaults: the whole model below 1e9
            # parameters). Without all-gather-into-tensor (gloo) the gathered flat buffer
            # is also copied out per parameter: twice the bytes.
            live = min(psi - persist, int(z["stage3_max_live_parameters"]))
            gathered = (1 if cuda else 2) * a * live
        backward = 0
        params_note = f"ZeRO-3: 1/{W} + tensors under the persistence threshold whole"
        buffers_note = f"reduce bucket {rbs:,} ({'fp32' if comm == 4 else 'low precision'}) + gathered parameters"
    else:
        params = a * psi
        backward = bucket
        if stage == 2:
            grad_backward = a * psi_r  # the gradient partition
        else:
            grad_head, grad_layer, grads_full = a * sh.head_params, a * sh.layer_params, a * psi
        params_note = f"ZeRO-{stage}: whole on every rank"
        buffers_note = f"gradient bucket {rbs:,}" + (" ×2 (overlap_comm)" if overlap else "")
    if bucket_convert and stage < 3:
        buffers_note += " (+ fp32 copy)"
    optimizer = 12 * psi_r
    if ds.offload_optimizer != "none":
        host += 16 * psi_r  # master, m, v, fp32 gradients
        optimizer = 0
        step_temp = step_grads = 0
    else:
        # one flat fp32 partition: foreach AdamW (CUDA) makes one copy of it (sqrt of v),
        # the single-tensor path (CPU) two (sqrt and quotient)
        step_temp = (4 if cuda else 8) * psi_r
        step_grads = 4 * psi_r
    return ZeroStates(
        params=params,
        optimizer=optimizer,
        host=host,
        persistent=persistent,
        grad_partition=grad_partition,
        grad_backward=grad_backward,
        backward=backward,
        gathered=gathered,
        grad_head=grad_head,
        grad_layer=grad_layer,
        grads_full=grads_full,
        reduce=bucket_convert if stage < 3 else 0,
        step_grads=step_grads,
        step_temp=step_temp,
        notes={
            "params": params_note,
            "optimizer": f"{master}, 1/{W}"
            + (" (offloaded to host)" if ds.offload_optimizer != "none" else ""),
            "buffers": buffers_note,
        },
    )


# --------------------------------------------------------------------------- activations


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

    @property
    def layer(self) -> int:
        """What one layer saves without checkpointing."""
        return 2 * self.norm + self.attention_saved + self.mlp_saved


def activations(cfg: RunConfig, sh: ModelShape, lay: Layout, a: int, cuda: bool, kernel: str):
    m = cfg.model
    P, T, S = lay.sp, lay.tokens, lay.full_tokens
    U, R = lay.ulysses, lay.ring
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
        fixed += flex_block_mask_bytes(lay.micro_batch, lay.seq_len)
    if kernel == "sdpa_dense":
        # the [b, 1, s, s] boolean mask (once per step) and, saved by every layer's
        # kernel, the additive mask SDPA makes of it in the compute dtype: O(s²) per rank
        # whatever sp is
        fixed += lay.micro_batch * lay.seq_len**2
        kernel_saved += a * lay.micro_batch * lay.seq_len**2
    packed = T * (Q + 2 * E) * a
    if U > 1:
        # the exchanges' send buffer: one workspace the size of the largest exchange (q, k,
        # v packed), kept for the whole run (ulysses_mm.parallel.comm.Workspace)
        fixed += packed
        # the caller's q, k, v, the replicated k, v, (for b > 1 the receive buffer: the
        # [b, P, n] -> [b, s] reshape then copies), and at the return exchange the kernel
        # output, its contiguous copy and the receive buffer
        rep = 2 * T * E * a if e > sh.kv_heads else 0
        recv = packed if lay.micro_batch > 1 else 0
        attn_fwd = T * (Q + 2 * K) * a + rep + recv + 3 * T * Q * a
        # output-gradient exchange (2Q), kernel gradients (Q + 2E), q/k/v-gradient
        # exchange once the kernel's inputs are freed (4E net)
        attn_bwd = max(T * (Q + 2 * E) * a, 2 * T * Q * a, 4 * T * E * a)
    else:
        attn_fwd = 2 * T * Q * a  # the output concatenated per document, then per row
        attn_bwd = T * (Q + 2 * E) * a  # dq, dk, dv (the output gradient replaces o_in)
    ring_scores = ring_fwd = ring_bwd = 0
    if R > 1:
        ring_scores, ring_fwd, ring_bwd = _ring_attention(sh, lay, a, kernel == "ring_flash")
        kernel_saved = T * ((Q + 2 * E) * a + 4 * Q + 4 * sh.heads)
        # the ring's token indices (int64 [N/R] per ring rank) and document runs (int32
        # [b, N/R] per ring rank), made once per step
        fixed += 8 * lay.seq_len + 4 * S
        # before the ring (U > 1): the caller's q, k, v, the replicated k, v, the receive
        # buffer's copy (b > 1): what the Ulysses forward holds while its kernel runs
        pre = T * (Q + 2 * K) * a + rep + recv if U > 1 else 0
        attn_fwd = max(attn_fwd if U > 1 else 0, pre + ring_fwd)
        attn_bwd = max(attn_bwd, ring_bwd)
    if cuda and kernel in ("flash_varlen", "sdpa_varlen"):
        attn_bwd += 4 * T * Q  # the flash backward's fp32 dq accumulator
        if sh.heads > e:
            attn_bwd += 2 * T * Q * a  # GQA: dk, dv expanded to the query heads
    tiled = m.mlp_tile_tokens > 0 and lay.seq_len // P > m.mlp_tile_tokens
    if tiled:
        mt = m.mlp_tile_tokens * lay.micro_batch
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
    final_norm, final_norm_bwd = norm, norm_bwd
    lt = m.layer_tile_tokens * lay.micro_batch
    layer_tiled = m.layer_tile_tokens > 0 and lay.seq_len // P > m.layer_tile_tokens
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
        all_to_all=2 * packed if U > 1 else 0,
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
    )


def _ring_attention(sh: ModelShape, lay: Layout, a: int, flash: bool) -> tuple[int, int, int]:
    """Ring attention's (:mod:`ulysses_mm.parallel.ring`) working sets on one rank, beyond
    what it saves (q, k, v, its fp32 output and log-sum-exp): (one piece's [h, nq, nk]
    fp32 scores, the forward's set, the backward's set beyond the output gradient).

    A ring rank holds N/R tokens on hq/U query heads and e/U kv heads: T·Q and T·E
    elements. Each block runs as at most two varlen calls over the rows it gathers (q, k,
    v copies); flash-attn's (``flash``) keep no scores, the PyTorch kernel is dense per
    piece of one row's queries (nq = nk ≤ N/R) and works in fp32."""
    T, U, b = lay.tokens, lay.ulysses, lay.micro_batch
    Q = sh.q_width
    E = sh.kv_expanded(U) * sh.head_dim
    n = lay.seq_len // lay.ring
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


# --------------------------------------------------------------------------- phases


@dataclass
class Term:
    """One line of a breakdown: bytes on the device."""

    name: str
    bytes: int


@dataclass
class Phase:
    """The tensors live at one phase's high point."""

    name: str
    terms: list[Term]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)


def phases(
    cfg: RunConfig,
    sh: ModelShape,
    zs: ZeroStates,
    act: Activations,
    a: int,
    offload_checkpoints: bool | None = None,
) -> list[Phase]:
    """Every phase of a step whose high point can be the peak. ``offload_checkpoints``
    (default: the config's) counts the checkpointed layer inputs in host memory."""
    L = sh.layers
    x = act.residual
    ckpt = cfg.model.activation_checkpointing
    if offload_checkpoints is None:
        offload_checkpoints = cfg.model.offload_checkpoints
    offload = ckpt and offload_checkpoints
    gas = cfg.deepspeed.gradient_accumulation_steps
    tiled = act.layer_tile_tokens > 0
    # stash: what the layers before the one at work keep
    per_layer = x if ckpt else (x + act.tile_saved if tiled else act.layer)
    stash_scale = 0 if offload else 1
    # offloaded: the layer's input fetched back, and the one before it, prefetched
    fetched = x if offload else 0
    if tiled:
        recompute = act.tile_saved
    else:
        recompute = act.layer - (x if a == 4 else 0)  # fp32: the first norm saves the input
    base = [
        Term("parameters", zs.params),
        Term("optimizer states", zs.optimizer),
        Term("gradient partition", zs.grad_partition),
        Term("DeepSpeed persistent buffers", zs.persistent),
    ]

    def grads(layers_done: int, reducing: bool) -> Term:
        # with gradient accumulation ZeRO-0/1 keep every gradient between micro-steps;
        # ZeRO-2's partition exists from the first bucket reduction on
        g = zs.grads_full if gas > 1 else zs.grad_head + layers_done * zs.grad_layer
        return Term("gradients", g + (zs.grad_backward if reducing or gas > 1 else 0))

    def bwd(layers_done: int, reducing: bool = True) -> list[Term]:
        """Backward: ZeRO-2 reduces buckets as they fill, from the layers on (its
        communication-dtype copy counted at every layer); ZeRO-1 reduces at the end."""
        reduce = zs.reduce if reducing and cfg.deepspeed.zero_stage == 2 else 0
        return [
            *base,
            grads(layers_done, reducing),
            Term("DeepSpeed gradient buffers", zs.backward + reduce),
            Term("gathered parameters", zs.gathered),
            Term("batch, RoPE tables, document ids", act.fixed),
        ]

    out: list[Phase] = []
    if tiled:
        attn_live = act.kernel_saved + act.attention_forward + (act.qkv if a == 4 else 0)
    else:
        attn_live = act.norm + act.kernel_saved + act.attention_forward
    if ckpt:
        # the last layer's attention recomputed in backward
        out.append(
            Phase(
                "backward: recomputing the last layer's attention",
                [
                    *bwd(0),
                    Term("checkpointed layer inputs", (L - 1) * x * stash_scale + x + fetched),
                    Term("gradient of the residual stream", x),
                    Term("attention working set", attn_live - (x if a == 4 and not tiled else 0)),
                ],
            )
        )
    else:
        out.append(
            Phase(
                "forward: the last layer's attention",
                [
                    *base,
                    Term("gathered parameters", zs.gathered),
                    Term("gradients", zs.grads_full if gas > 1 else 0),
                    Term("batch, RoPE tables, document ids", act.fixed),
                    Term("saved activations of the other layers", (L - 1) * per_layer),
                    Term("layer input", x if a != 4 or tiled else 0),
                    Term("attention working set", attn_live),
                ],
            )
        )
    if act.mlp_tile_tokens or tiled:
        if tiled:  # the tiles after attention: their outputs, then their concatenation
            mlp_live = act.tile_saved + 2 * x + act.tile_forward
        else:
            mlp_live = 2 * act.norm + act.attention_saved + act.mlp_forward
        if ckpt:
            terms = [
                *bwd(0),
                Term("checkpointed layer inputs", (L - 1) * x * stash_scale + x + fetched),
                Term("gradient of the residual stream", x),
                Term("MLP working set", mlp_live - (x if a == 4 and not tiled else 0)),
            ]
            name = "backward: recomputing the last layer's MLP tiles"
        else:
            terms = [
                *base,
                Term("gathered parameters", zs.gathered),
                Term("gradients", zs.grads_full if gas > 1 else 0),
                Term("batch, RoPE tables, document ids", act.fixed),
                Term("saved activations of the other layers", (L - 1) * per_layer),
                Term("layer input", x if tiled else 0),
                Term("MLP working set", mlp_live),
            ]
            name = "forward: the last layer's MLP tiles"
        out.append(Phase(name, terms))
    stash_all = L * per_layer * stash_scale
    out.append(
        Phase(
            "backward: a loss tile",
            [
                *bwd(0, reducing=False),
                Term("saved activations", stash_all),
                Term("final norm", act.final_norm),
                Term("loss tile and the hidden states' gradient", act.loss),
            ],
        )
    )
    out.append(
        Phase(
            "backward: the final norm",
            [
                *bwd(0, reducing=False),
                Term("saved activations", stash_all),
                Term("final norm", act.final_norm),
                Term("norm backward working set", act.final_norm_backward),
            ],
        )
    )
    for j, label in ((L - 1, "the last layer"), (0, "the first layer")):
        done = L - 1 - j  # layers whose gradients already exist
        before = j * per_layer * stash_scale + (x if ckpt else 0) + (fetched if j else 0)
        this = recompute if ckpt else per_layer - (x if tiled else 0)
        common = [*bwd(done), Term("gradient of the residual stream", x)]
        if tiled:
            # the tiles after attention, backward: the input's and the kernel output's
            # gradient buffers fill; then the kernel's backward; then the tiles before it
            # (q, k, v gradients in, a second input-gradient buffer)
            out += [
                Phase(
                    f"backward: {label}'s tiles after attention",
                    [
                        *common,
                        Term("saved activations", before + this),
                        Term("gradient buffers (input, kernel output)", x + act.o),
                        Term("tile backward working set", act.tile_backward),
                    ],
                ),
                Phase(
                    f"backward: {label}'s attention",
                    [
                        *bwd(done),
                        Term("saved activations", before + this - act.o),
                        Term("gradient buffer (input)", x),
                        Term("attention backward working set", act.attention_backward),
                    ],
                ),
                Phase(
                    f"backward: {label}'s tiles before attention",
                    [
                        *bwd(done),
                        Term("saved activations", before),
                        Term("q, k, v gradients", act.qkv),
                        Term("gradient buffers (input, twice)", 2 * x),
                        Term("tile backward working set", act.tile_backward),
                    ],
                ),
            ]
            continue
        out.append(
            Phase(
                f"backward: {label}'s MLP",
                [
                    *common,
                    Term("saved activations", before + this),
                    Term("MLP backward working set", act.mlp_backward),
                ],
            )
        )
        out.append(
            Phase(
                f"backward: {label}'s second norm",
                [
                    *common,
                    Term("saved activations", before + this - act.mlp_saved),
                    Term("norm backward working set", act.norm_backward),
                ],
            )
        )
        out.append(
            Phase(
                f"backward: {label}'s attention",
                [
                    *common,
                    Term("saved activations", before + this - act.mlp_saved - act.norm),
                    Term("attention backward working set", act.attention_backward),
                ],
            )
        )
    if cfg.deepspeed.zero_stage == 1:
        out.append(
            Phase(
                "gradient reduction (end of backward)",
                [
                    *base,
                    Term("gradients", zs.grads_full),
                    Term("DeepSpeed gradient buffers", zs.backward + zs.reduce),
                    Term("batch", act.inputs),
                ],
            )
        )
    if cfg.deepspeed.zero_stage == 0:
        out.append(
            Phase(
                "gradient all-reduce",
                [
                    *base,
                    Term("gradients", zs.grads_full),
                    Term("DeepSpeed gradient buffers", zs.reduce),
                    Term("batch", act.inputs),
                ],
            )
        )
    out.append(
        Phase(
            "optimizer step",
            [
                *base,
                Term("gradients", zs.step_grads),
                Term("optimizer step temporaries", zs.step_temp),
                Term("batch", act.inputs),
            ],
        )
    )
    return out


# --------------------------------------------------------------------------- result


@dataclass
class Estimate:
    """Per-rank memory of one training step (bytes)."""

    config: str
    space: dict[str, int]
    space_from: str
    layout: Layout
    precision: str
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    activation_checkpointing: bool
    offload_checkpoints: bool
    kernel: str
    device: str
    params: int
    shape: ModelShape
    states: dict[str, int]  # parameters, optimizer states, DeepSpeed buffers
    state_notes: dict[str, str]
    act: Activations
    phases: list[Phase]
    peak_phase: str
    peak: int  # tensor bytes at the peak
    headroom_fraction: float  # allocator headroom as a fraction of the peak (GPU only)
    reserve: int  # runtime reserve (GPU only)
    host: int  # bytes per rank in host memory (offloaded states)
    offloaded_peak: int | None  # the peak with checkpoints offloaded (what-if)
    gpu_mem: int | None = None
    notes: list[str] = field(default_factory=list)
    # bytes one rank sends per layer: the all-to-all over U ranks and the ring of R
    # (ulysses_mm.parallel.ring.ring_theory_bytes), forward and backward
    sent_per_layer: dict[str, int] = field(default_factory=dict)

    @property
    def headroom(self) -> int:
        return int(self.headroom_fraction * self.peak)

    @property
    def total(self) -> int:
        return self.peak + self.headroom + self.reserve

    @property
    def offloaded_total(self) -> int | None:
        """The total with checkpoints offloaded to the host (what-if)."""
        if self.offloaded_peak is None:
            return None
        return int(self.offloaded_peak * (1 + self.headroom_fraction)) + self.reserve

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_mem is None else self.total <= self.gpu_mem

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = {**asdict(self.layout), "dp": self.layout.dp, "tokens": self.layout.tokens}
        d["activations"] = d.pop("act")
        d["activations"]["layer"] = self.act.layer
        d["phases"] = {p.name: {t.name: t.bytes for t in p.terms} for p in self.phases}
        d["headroom"] = self.headroom
        d["total"] = self.total
        d["offloaded_total"] = self.offloaded_total
        d["fits"] = self.fits
        return d


def estimate(
    cfg: RunConfig,
    seq_len: int,
    *,
    gpus: int | None = None,
    sp: int | None = None,
    space: TokenSpace | None = None,
    space_from: str = "",
    device: str = "cuda",
    headroom: float = 0.10,
    reserve_gib: float | None = None,
    nccl_gib: float = NCCL_GIB_PER_COMMUNICATOR,
    gpu_mem_gib: float | None = None,
    config_name: str = "",
) -> Estimate:
    """Per-rank memory of one training step of ``cfg`` at ``seq_len`` tokens per sample.

    ``device='cuda'`` estimates a GPU (foreach AdamW, flash scratch, allocator headroom,
    runtime reserve); ``device='cpu'`` the tensor memory of a CPU process, which
    :mod:`ulysses_mm.tools.measure` measures. The runtime reserve is CONTEXT_RESERVE_GIB plus
    ``nccl_gib`` per NCCL communicator of the layout, or ``reserve_gib`` flat when given."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    if space is None:
        space, space_from = token_space(cfg)
    ds = cfg.deepspeed
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        raise ValueError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        raise ValueError("deepspeed.offload_param needs deepspeed.zero_stage=3")
    lay = layout_for(cfg, seq_len, gpus, sp)
    sh = model_shape(cfg, space)
    from ulysses_mm.model.attention import choose_kernel

    cuda = device == "cuda"
    # the kernel a GPU with flash-attn (or a CPU) runs for this precision
    kernel = choose_kernel(cfg.parallel.attention, device, ds.precision, flash=cuda)
    if lay.ring > 1:
        # ring attention's blocks replace the local kernel: flash-attn's varlen calls where
        # it runs, the dense PyTorch kernel elsewhere
        kernel = "ring_flash" if kernel == "flash_varlen" else "ring"
    a = 4 if ds.precision == "fp32" else 2
    zs = zero_states(cfg, sh, space, a, lay.gpus, lay.sp, cuda)
    act = activations(cfg, sh, lay, a, cuda, kernel)
    steps = phases(cfg, sh, zs, act, a)
    top = max(steps, key=lambda p: p.bytes)
    offloaded = None
    host = zs.host
    if cfg.model.offload_checkpoints:
        host += sh.layers * act.residual  # every layer's input, on the host
    elif cfg.model.activation_checkpointing:
        offloaded = max(p.bytes for p in phases(cfg, sh, zs, act, a, offload_checkpoints=True))
    notes = []
    if kernel == "sdpa_dense":
        notes.append("sdpa_dense keeps [b, s, s] masks: memory grows with s² whatever sp is")
    if kernel == "flex":
        notes.append(
            "flex attention is counted like the flash kernels, plus its block mask "
            f"({flex_block_mask_bytes(lay.micro_batch, lay.seq_len) / (1 << 20):.1f} MiB)"
        )
    if kernel == "ring":
        notes.append(
            "ring attention's PyTorch block kernel is dense: five [hq/U, N/R, N/R] fp32 at once "
            f"in backward ({_size(5 * act.ring_scores)}), growing with (N/R)² whatever U is"
        )
    if cuda and reserve_gib is None:
        reserve = int((CONTEXT_RESERVE_GIB + nccl_gib * lay.communicators) * GiB)
    else:
        reserve = int((reserve_gib or 0.0) * GiB) if cuda else 0
    return Estimate(
        config=config_name,
        space=space.vocab(),
        space_from=space_from,
        layout=lay,
        precision=ds.precision,
        zero_stage=ds.zero_stage,
        offload_optimizer=ds.offload_optimizer,
        offload_param=ds.offload_param,
        activation_checkpointing=cfg.model.activation_checkpointing,
        offload_checkpoints=cfg.model.offload_checkpoints,
        kernel=kernel,
        device=device,
        params=sh.params,
        shape=sh,
        states={
            "params": zs.params,
            "optimizer": zs.optimizer,
            "persistent": zs.persistent,
        },
        state_notes=zs.notes,
        act=act,
        phases=steps,
        peak_phase=top.name,
        peak=top.bytes,
        headroom_fraction=headroom if cuda else 0.0,
        reserve=reserve,
        host=host,
        offloaded_peak=offloaded,
        gpu_mem=int(gpu_mem_gib * GiB) if gpu_mem_gib else None,
        notes=notes,
        sent_per_layer=sent_per_layer(sh, lay, a),
    )


def sent_per_layer(sh: ModelShape, lay: Layout, a: int) -> dict[str, int]:
    """Bytes one rank sends per layer: the all-to-all (q, k, v in and the output back over
    the U ranks of a Ulysses group, on N/R tokens; the gradients the same way back) and
    the ring's K/V blocks (backward: again, with their fp32 dK/dV)."""
    from ulysses_mm.parallel.ring import ring_theory_bytes

    U, R, b = lay.ulysses, lay.ring, lay.micro_batch
    width = 2 * sh.q_width + 2 * sh.kv_expanded(U) * sh.head_dim  # q + out + k + v
    a2a = (lay.seq_len // R) * width // U * (U - 1) // U * a * b
    ring_fwd, ring_bwd = ring_theory_bytes(
        lay.seq_len, R, U, sh.heads, sh.kv_heads, sh.head_dim, b, elem_bytes=a
    )
    return {
        "all_to_all_forward": a2a,
        "all_to_all_backward": a2a,
        "ring_forward": ring_fwd,
        "ring_backward": ring_bwd,
    }


# --------------------------------------------------------------------------- search


def max_seq_len(
    cfg: RunConfig, gpu_mem_gib: float, limit: int = 1 << 34, **kw: Any
) -> tuple[int, Estimate]:
    """The longest sequence (a multiple of sp × MAX_GRANULARITY tokens) whose estimate
    fits ``gpu_mem_gib``, and its estimate; (0, the estimate at the smallest length) when
    none does. ``kw`` as for :func:`estimate`. The estimate grows with the length, so
    doubling then bisection finds it."""
    first = estimate(cfg, _granule(cfg, kw), gpu_mem_gib=gpu_mem_gib, **kw)
    g = first.layout.sp * MAX_GRANULARITY
    if not first.fits:
        return 0, first
    lo, best = 1, first
    hi = 2
    while hi * g <= limit:
        est = estimate(cfg, hi * g, gpu_mem_gib=gpu_mem_gib, **kw)
        if not est.fits:
            break
        lo, best, hi = hi, est, hi * 2
    else:
        return lo * g, best
    while hi - lo > 1:
        mid = (lo + hi) // 2
        est = estimate(cfg, mid * g, gpu_mem_gib=gpu_mem_gib, **kw)
        if est.fits:
            lo, best = mid, est
        else:
            hi = mid
    return lo * g, best


def _granule(cfg: RunConfig, kw: dict[str, Any]) -> int:
    sp = kw.get("sp")
    if sp is None:
        sp = kw.get("gpus") or cfg.parallel.sp
    return int(sp) * MAX_GRANULARITY


# --------------------------------------------------------------------------- report


def _size(n: int) -> str:
    div, unit = _unit(n)
    return f"{n / div:.2f} {unit}"


def _unit(total: int) -> tuple[float, str]:
    return (GiB, "GiB") if total >= GiB else (1 << 20, "MiB")


def render(est: Estimate, all_phases: bool = False) -> str:
    """The breakdown as text (what ``ulysses-mm estimate`` prints)."""
    div, unit = _unit(est.total)
    lay, sh, act = est.layout, est.shape, est.act
    L = sh.layers

    def row(name: str, b: int | float, note: str = "", indent: int = 1) -> str:
        label = "  " * indent + name
        return f"{label:<64s}{b / div:9.2f}   {note}".rstrip()

    e = sh.kv_expanded(lay.ulysses)
    replicated_for = f"ulysses={lay.ulysses}" if lay.ring > 1 else f"sp={lay.sp}"
    training = [est.precision, f"ZeRO-{est.zero_stage}"]
    if est.offload_optimizer != "none":
        training.append(f"optimizer offload to {est.offload_optimizer}")
    if est.offload_param != "none":
        training.append(f"parameter offload to {est.offload_param}")
    if est.activation_checkpointing:
        training.append("activation checkpointing")
    if est.offload_checkpoints:
        training.append("checkpoints offloaded to host")
    if act.layer_tile_tokens:
        training.append(f"layer tiles of {act.layer_tile_tokens:,}")
    elif act.mlp_tile_tokens:
        training.append(f"MLP tiles of {act.mlp_tile_tokens:,}")
    training.append(f"loss tiles of {act.loss_tile_tokens:,}")
    training.append(f"kernel {est.kernel}" + (" (CPU tensors)" if est.device == "cpu" else ""))
    out = [
        f"ulysses-mm estimate{': ' + est.config if est.config else ''}",
        f"model     {est.params / 1e9:.3f} B parameters: {L} layers, D {sh.hidden}, MLP "
        f"{sh.inter}, heads {sh.heads}/{sh.kv_heads} kv"
        + (f" (replicated to {e} for {replicated_for})" if e != sh.kv_heads else "")
        + f", head dim {sh.head_dim}",
        "tokens    "
        + ", ".join(f"{k} {v}" for k, v in est.space.items())
        + f" ({est.space_from}); widest head {sh.widest_head} logits",
        f"world     {lay.gpus} GPU{'s' if lay.gpus > 1 else ''} = dp {lay.dp} × sp {lay.sp}"
        + (f" (ulysses {lay.ulysses} × ring {lay.ring})" if lay.ring > 1 else "")
        + "; "
        f"{lay.seq_len:,} tokens per sample, {lay.seq_len // lay.sp:,} per GPU, micro-batch "
        f"{lay.micro_batch}",
        "training  " + ", ".join(training),
        "",
        f"{'  per GPU':<64s}{unit:>9s}",
    ]
    peak = est.phase(est.peak_phase)
    at = {t.name: t.bytes for t in peak.terms}
    n = est.state_notes
    buffers = (
        at.get("DeepSpeed gradient buffers", 0)
        + at.get("DeepSpeed persistent buffers", 0)
        + at.get("gathered parameters", 0)
    )
    if act.layer_tile_tokens:
        recompute = act.tile_saved
        mlp = f"layer tile of {act.layer_tile_tokens:,} tokens, backward"
        mlp_bytes = act.tile_backward
    else:
        recompute = act.layer - (act.residual if est.precision == "fp32" else 0)
        mlp = (
            f"MLP tile of {act.mlp_tile_tokens:,} tokens, backward"
            if act.mlp_tile_tokens
            else "MLP backward (no tiling)"
        )
        mlp_bytes = act.mlp_backward
    offload_label = "kept, checkpoints offloaded to host" + (
        " (fetched + prefetched)" if est.offload_checkpoints else " (what-if)"
    )
    out += [
        row("parameters", est.states["params"], n["params"]),
        row("gradients, at the peak", at.get("gradients", 0) + at.get("gradient partition", 0)),
        row("optimizer states", est.states["optimizer"], n["optimizer"]),
        f"  activations of one layer at {act.tokens:,} tokens",
        row("saved, without checkpointing", act.layer, f"× {L} = {act.layer * L / div:.2f}", 2),
        row(
            "kept, with checkpointing (the layer input)",
            act.residual,
            f"× {L} = {act.residual * L / div:.2f}",
            2,
        ),
        row(
            offload_label,
            2 * act.residual if est.offload_checkpoints else 0,
            f"host {act.residual * L / div:.2f}",
            2,
        ),
        row("recomputed in backward, one layer at a time", recompute, indent=2),
        "  attention of one layer",
        row("q, k, v after the all-to-all [b, s, hq/P + 2e/P, d]", act.after_all_to_all, indent=2),
        row("forward working set", act.attention_forward, indent=2),
        row("backward working set", act.attention_backward, indent=2),
    ]
    if lay.ring > 1:
        n_r = lay.seq_len // lay.ring
        if act.ring_scores:
            out.append(
                row(
                    f"ring block scores [{sh.heads // lay.ulysses}, {n_r:,}, {n_r:,}] fp32 (per row)",
                    act.ring_scores,
                    "× 3 in forward, × 5 in backward",
                    2,
                )
            )
        out += [
            row(
                "ring forward: K/V block + the one in flight, block kernel",
                act.ring_forward,
                indent=2,
            ),
            row("ring backward: + dK/dV (fp32), dq, block gradients", act.ring_backward, indent=2),
        ]
    out += [
        "  tiles",
        row(mlp, mlp_bytes, indent=2),
        row(
            f"loss tile of {act.loss_tile_tokens:,} tokens × {sh.widest_head} logits, backward",
            act.loss,
            indent=2,
        ),
        "  communication buffers",
        row("all-to-all send + receive (one exchange of q, k, v)", act.all_to_all, indent=2),
        row("DeepSpeed buckets and gathered parameters, at the peak", buffers, n["buffers"], 2),
    ]
    sent = est.sent_per_layer
    if sent and lay.sp > 1:
        mib = 1 << 20
        out.append("  sent per rank per layer (forward / backward)")
        rows = [("all_to_all", f"all-to-all over {replicated_for.replace('=', ' ')}")]
        if lay.ring > 1:
            rows.append(("ring", f"ring of {lay.ring} (K/V blocks; backward + dK/dV)"))
        for key, label in rows:
            fwd, bwd = sent[f"{key}_forward"], sent[f"{key}_backward"]
            out.append(f"    {label:<60s}{fwd / mib:9.2f} / {bwd / mib:.2f} MiB")
    out += ["", f"  at the peak ({est.peak_phase})"]
    out += [row(t.name, t.bytes, indent=2) for t in peak.terms if t.bytes]
    out.append(row("tensor peak", est.peak))
    if est.device == "cuda":
        out.append(
            row(f"allocator headroom, {est.headroom_fraction:.0%} of the peak", est.headroom)
        )
        comms = est.layout.communicators
        out.append(
            row(
                "runtime reserve: CUDA context, cuBLAS, NCCL",
                est.reserve,
                f"{comms} NCCL communicator{'s' if comms != 1 else ''}" if comms else "",
            )
        )
    verdict = ""
    if est.gpu_mem is not None:
        spare = est.gpu_mem - est.total
        verdict = f"of {est.gpu_mem / GiB:g} GiB: " + (
            f"fits, {spare / div:.2f} {unit} spare"
            if spare >= 0
            else f"DOES NOT FIT, {-spare / div:.2f} {unit} over"
        )
    out.append(row("total", est.total, verdict))
    if est.offloaded_total is not None:
        out.append(row("total with checkpoints offloaded to host (what-if)", est.offloaded_total))
    if est.host:
        out.append(row("host memory per GPU (offloaded states and checkpoints)", est.host))
    out += [f"  note: {x}" for x in est.notes]
    if all_phases:
        out += ["", "  phases (tensors live at each high point)"]
        out += [row(p.name, p.bytes, indent=2) for p in est.phases]
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


def run_cli(args: Any) -> int:
    """``ulysses-mm estimate`` (arguments from :func:`ulysses_mm.cli._add_estimate`)."""
    import json

    from ulysses_mm.config import load_config

    cfg = load_config(RunConfig, args.config, args.overrides)
    space, space_from = token_space(cfg, args.manifest)
    kw: dict[str, Any] = dict(
        gpus=args.gpus,
        sp=args.sp,
        space=space,
        space_from=space_from,
        device=args.device,
        headroom=args.headroom,
        reserve_gib=args.reserve,
        nccl_gib=getattr(args, "nccl_reserve", NCCL_GIB_PER_COMMUNICATOR),
        config_name=str(args.config),
    )
    longest = None
    if args.max:
        if args.gpu_mem is None:
            raise ValueError("--max needs --gpu-mem GB (the memory of one GPU)")
        longest, est = max_seq_len(cfg, args.gpu_mem, **kw)
    else:
        seq_len = args.seq_len or cfg.data.seq_len
        if not seq_len:
            raise ValueError(
                "give --seq-len N or --max (data.seq_len is 0 in this config: the manifest's)"
            )
        est = estimate(cfg, seq_len, gpu_mem_gib=args.gpu_mem, **kw)
    if args.json:
        out = est.to_dict()
        if args.max:
            out["max_seq_len"] = longest
        print(json.dumps(out, indent=1))
        return 0
    if args.max:
        lay = est.layout
        if not longest:
            print(
                f"nothing fits: even {lay.seq_len:,} tokens need {est.total / GiB:.2f} GiB per "
                f"GPU, more than {args.gpu_mem:g} GiB\n"
            )
        else:
            print(
                f"longest sequence that fits: {longest:,} tokens ({longest // lay.sp:,} per GPU) "
                f"on {lay.gpus} GPU{'s' if lay.gpus > 1 else ''} of {args.gpu_mem:g} GiB "
                f"(sp {lay.sp}, dp {lay.dp}; a multiple of sp × {MAX_GRANULARITY})\n"
            )
    print(render(est, args.phases))
    return 0
