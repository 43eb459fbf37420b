"""How long one training step takes on a device kind: the FLOPs the step does, the bytes
it moves, each over the rate its device reaches (:mod:`.devices`).

- **FLOPs** are ``train.flops.train_flops``'s count (decoder parameters per token, causal
  attention per (query, key) pair inside documents, each target's output head), taken from
  the model built on the meta device, so the count is the one MFU is logged with. The pairs
  per sample come from the documents (:mod:`.documents`). Executed FLOPs add what the memory
  policy recomputes: activation checkpointing runs each layer's forward again in backward
  (dense and attention × 4/3), head groups run each group's attention forward once more
  (attention + 1/3), loss tiles run the head's forward again (heads × 4/3).
- **Ulysses all-to-all**: :func:`.comm.sent_per_layer`'s bytes per layer (forward and
  backward; the forward again under activation checkpointing) over NVLink when the U ranks
  of a Ulysses group share a node, else the part to other nodes over the network; it is on
  the critical path (attention waits for it). A call costs the link's latency too.
- **Ring**: the K/V blocks :func:`.comm.sent_per_layer` counts, over the slowest hop of
  the ring, overlapped with the ring's attention.
- **DP / ZeRO**: gradients reduced over the whole world (the SP ranks of a group hold the
  same parameters): an all-reduce (ZeRO-0), a reduce-scatter and the updated parameters'
  all-gather (ZeRO-1/2), and under ZeRO-3 the parameters gathered for forward, backward
  (and the recomputed forward); overlapped with compute.
- **Offload**: the optimizer offloaded moves gradients down and parameters up over PCIe
  and runs Adam on the host (exposed); offloaded parameters come over PCIe for every
  gather and offloaded checkpoints go down and back (overlapped).
- **Optimizer step** on the device: bound by HBM bandwidth.

Overlappable communication hides behind ``overlap`` × the compute time; what does not is
the exposed communication. DP ranks with unequal samples: the compute is that of the
slowest rank, from steps of samples drawn from the documents
(:func:`~ulysses_mm.loader.balance.simulate`), balanced when ``data.balance`` is on. Not
modelled: pipeline bubbles (there are none here), data loading, kernel launch
gaps, the memory-bound element-wise work outside matmuls and attention (in the matmul
efficiency).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.balance import Imbalance, sample_work, simulate
from ulysses_mm.tools.estimate.devices import DeviceKind, Efficiency
from ulysses_mm.tools.estimate.documents import DocLengths
from ulysses_mm.tools.estimate.result import Estimate
from ulysses_mm.tools.estimate.zero import _comm_bytes

# bytes the device's AdamW step reads and writes per parameter of its partition: fp32
# master, m, v read and written, the gradient read, the compute-dtype copy written
_ADAM_BYTES = 4 * 3 * 2 + 4 + 2


@dataclass(frozen=True)
class FlopRates:
    """``train_flops``'s count split into its three linear parts: per token (decoder
    parameters), per (query, key) pair, per target of the widest head."""

    per_token: float
    per_pair: float
    per_target: float
    head: str  # the modality whose head the targets go through (the widest)


def flop_rates(cfg: RunConfig, space: TokenSpace) -> FlopRates:
    """:func:`ulysses_mm.train.flops.train_flops` of ``cfg``'s model built on the meta
    device (no memory), one unit of each input at a time."""
    import torch  # lazy: the estimate's memory path stays torch-free

    from ulysses_mm.loader.synthetic import largest_head  # lazy: imports torch
    from ulysses_mm.model.llama import MultimodalLM  # lazy: imports torch
    from ulysses_mm.train.flops import train_flops  # lazy: imports torch

    with torch.device("meta"):
        model = MultimodalLM(cfg.model, space, "sdpa_varlen")
    head = largest_head(space)
    return FlopRates(
        per_token=train_flops(model, 1, 0.0, {}),
        per_pair=train_flops(model, 0, 1.0, {}),
        per_target=train_flops(model, 0, 0.0, {head: 1}),
        head=head,
    )


@dataclass
class StepTime:
    """One training step's predicted time on ``gpus`` devices of one kind (seconds)."""

    device: str
    efficiency: Efficiency
    docs: str
    tokens: int  # tokens per step over the world
    pairs_per_sample: float
    model_flops: float  # train_flops of the step (what MFU counts)
    executed_flops: dict[str, float]  # dense, attention, heads with recomputation
    seconds: dict[str, float]  # each part, before overlap
    exposed: dict[str, float]  # each part's time on the critical path
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per rank per step
    # the slowest DP rank's work over the mean: in order, balanced, the one counted
    dp_imbalance: dict[str, float] = field(default_factory=dict)
    peak_flops: float = 0.0  # of the world
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.exposed.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops)

    def time_for(self, tokens: float) -> float:
        """Seconds to train on ``tokens`` tokens."""
        return tokens / self.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(step_s=self.step_s, tokens_per_s=self.tokens_per_s, mfu=self.mfu)
        return d


def dp_imbalance(
    docs: DocLengths, seq_len: int, rates: FlopRates, dp: int, micro_batch: int, count: int
) -> Imbalance:
    """How much longer than the mean the slowest of ``dp`` ranks computes, for samples
    of ``seq_len`` tokens holding ``docs``: :func:`~ulysses_mm.loader.balance.simulate`
    over the samples' work (their pairs + the dense FLOPs per token in pairs)."""
    pairs = docs.window_pairs(seq_len)
    if dp <= 1 or len(pairs) < 2 or not rates.per_pair:
        return Imbalance(1.0, 1.0, 0)
    work = sample_work(pairs, seq_len, (rates.per_token + rates.per_target) / rates.per_pair)
    return simulate(work, dp, micro_batch, count, steps=32)


def _link(dev: DeviceKind, ranks: int, span: int, gpus_per_node: int) -> tuple[float, float, bool]:
    """(bytes/s, latency, crosses nodes) of a collective among ``ranks`` ranks ``span``
    apart (consecutive: 1): the network when they do not share one node."""
    crosses = ranks > 1 and ranks * span > gpus_per_node
    if crosses:
        return dev.inter_bytes_s, dev.inter_latency_s, True
    return dev.intra_bytes_s, dev.intra_latency_s, False


def step_time(
    cfg: RunConfig,
    est: Estimate,
    rates: FlopRates,
    docs: DocLengths,
    dev: DeviceKind,
    eff: Efficiency,
) -> StepTime:
    """The step of ``est`` (its layout, length, memory policy and ZeRO settings) on
    devices of kind ``dev`` at efficiencies ``eff``, its samples holding ``docs``."""
    step, sh = est.step, est.shape
    W, U, R, C = step.gpus, step.ulysses_size, step.ring_size, step.head_groups
    ga = cfg.deepspeed.gradient_accumulation_steps
    a = 4 if est.precision == "fp32" else 2
    ac = est.activation_checkpointing
    node = est.gpus_per_node

    samples = step.micro_batch * step.dp * ga
    tokens = samples * step.seq_len
    pairs = docs.pairs_per_sample(step.seq_len)
    dense = rates.per_token * tokens
    attn = rates.per_pair * pairs * samples
    heads = rates.per_target * tokens
    model_flops = dense + attn + heads
    executed = {
        "dense": dense * (4 / 3 if ac else 1.0),
        "attention": attn * ((4 / 3 if ac else 1.0) + (1 / 3 if C > 1 else 0.0)),
        "heads": heads * (4 / 3 if cfg.model.loss_tile_tokens else 1.0),
    }
    t_matmul = (executed["dense"] + executed["heads"]) / W / (dev.peak_flops * eff.matmul)
    t_attn = executed["attention"] / W / (dev.attention_peak * eff.attention)
    if dev.attention_row_s:  # every query row of every query head a rank holds
        passes = executed["attention"] / attn if attn else 1.0
        rows = samples * step.seq_len * sh.heads * sh.layers / W
        t_attn += passes * rows * dev.attention_row_s / eff.attention
    # element-wise work: per token per layer (two norms, two residual adds, RoPE on q and
    # k, SwiGLU's gate), per target per vocabulary entry (the loss's softmax); forward
    # + backward. A datasheet row moves their bytes over HBM: forward reads and writes
    # each tensor once, backward about twice as much.
    per_token_layer, per_vocab = dev.token_layer_s, dev.target_vocab_s
    if not per_token_layer:
        touched = 10 * sh.hidden + 2 * (sh.q_width + sh.kv_width) + 3 * sh.inter
        per_token_layer = 3 * touched * a / (dev.hbm_bytes_s * eff.memory)
    if not per_vocab:
        per_vocab = 4 * 4 / (dev.hbm_bytes_s * eff.memory)  # fp32 logits, 4 passes
    rank_tokens = tokens / W
    t_elementwise = rank_tokens * sh.layers * per_token_layer * (4 / 3 if ac else 1.0)
    t_elementwise += (
        rank_tokens * sh.widest_head * per_vocab * (4 / 3 if cfg.model.loss_tile_tokens else 1.0)
    )
    # the slowest DP rank: each micro-step waits for it (loader.balance)
    imbalance = dp_imbalance(docs, step.seq_len, rates, step.dp, step.micro_batch, ga)
    slowest = imbalance.balanced if cfg.data.balance else imbalance.in_order
    t_matmul *= slowest
    t_attn *= slowest
    t_elementwise *= slowest
    compute = t_matmul + t_attn + t_elementwise

    sent = est.sent_per_layer
    L = sh.layers
    micro = ga  # micro-steps per step: the layer exchanges run once per micro-step
    # Ulysses all-to-all: forward, backward, the forward again when checkpointed
    a2a_bytes = (
        L * micro * (sent["all_to_all_forward"] * (2 if ac else 1) + sent["all_to_all_backward"])
    )
    a2a_calls = L * micro * C * (2 * (2 if ac else 1) + 2 + (1 if C > 1 else 0))
    t_a2a = 0.0
    if U > 1:
        bw, lat, crosses = _link(dev, U, 1, node)
        if crosses:  # the part to peers on other nodes goes over the network
            far = (U - min(U, node)) / (U - 1)
            t_a2a = max(
                a2a_bytes * (1 - far) / (dev.intra_bytes_s * eff.link),
                a2a_bytes * far / (bw * eff.link),
            )
        else:
            t_a2a = a2a_bytes / (bw * eff.link)
        t_a2a += a2a_calls * lat
    # ring attention's K/V blocks, the slowest hop (ring peers are U ranks apart)
    ring_bytes = L * micro * (sent["ring_forward"] * (2 if ac else 1) + sent["ring_backward"])
    t_ring = 0.0
    if R > 1:
        bw, lat, _ = _link(dev, R, U, node)
        t_ring = ring_bytes / (bw * eff.link) + L * micro * 3 * (R - 1) * lat
    # gradients and ZeRO's parameter traffic over the world
    P = sh.params
    g = _comm_bytes(cfg, step.sp, a)
    share = (W - 1) / W
    stage = est.zero_stage
    if stage == 0:
        dp_bytes = 2 * share * P * g
    elif stage in (1, 2):
        dp_bytes = share * P * g + share * P * a
    else:
        dp_bytes = micro * share * P * (a * (3 if ac else 2) + g)
    t_dp = 0.0
    if W > 1:
        bw, lat, _ = _link(dev, W, 1, node)
        t_dp = dp_bytes / (bw * eff.link)
    # host traffic: the offloaded optimizer (exposed), offloaded parameters and
    # checkpoints (overlapped)
    part = P / W
    pcie = dev.pcie_bytes_s * eff.link
    t_opt_offload = 0.0
    t_host = 0.0
    host_bytes = 0.0
    if est.offload_optimizer != "none":
        host_bytes += part * (g + a)
        t_opt_offload = part * (g + a) / pcie + part / dev.host_adam_params_s
        t_optimizer = 0.0
    else:
        t_optimizer = part * _ADAM_BYTES / (dev.hbm_bytes_s * eff.memory)
    if est.offload_param != "none":
        host_bytes += micro * part * a * (3 if ac else 2)
        t_host += micro * part * a * (3 if ac else 2) / pcie
    if est.offload_checkpoints:
        ckpt = 2 * micro * est.host_checkpoints
        host_bytes += ckpt
        t_host += ckpt / pcie

    hide = eff.overlap * compute
    exposed = {
        "compute": t_matmul,
        "attention": t_attn,
        "element-wise": t_elementwise,
        "all-to-all": t_a2a,
        "ring": max(0.0, t_ring - eff.overlap * t_attn),
        "dp comm": max(0.0, t_dp - hide),
        "offload": t_opt_offload + max(0.0, t_host - hide),
        "optimizer": t_optimizer,
    }
    seconds = {
        "compute": t_matmul,
        "attention": t_attn,
        "element-wise": t_elementwise,
        "all-to-all": t_a2a,
        "ring": t_ring,
        "dp comm": t_dp,
        "offload": t_opt_offload + t_host,
        "optimizer": t_optimizer,
    }
    notes = []
    if imbalance.in_order > 1.0 + 1e-9:
        notes.append(
            f"unequal samples across dp {step.dp}: the slowest rank's compute is "
            f"{imbalance.in_order:.3f} × the mean read in order, {imbalance.balanced:.3f} × "
            f"balanced (data.balance {'on' if cfg.data.balance else 'off'}; counted)"
        )
    if U > 1 and _link(dev, U, 1, node)[2]:
        notes.append(
            f"the Ulysses group of {U} spans nodes of {node}: its all-to-all crosses the network"
        )
    return StepTime(
        device=dev.name,
        efficiency=eff,
        docs=docs.describe(),
        tokens=tokens,
        pairs_per_sample=pairs,
        dp_imbalance={
            "in_order": imbalance.in_order,
            "balanced": imbalance.balanced,
            "counted": slowest,
        },
        model_flops=model_flops,
        executed_flops=executed,
        seconds=seconds,
        exposed=exposed,
        comm_bytes={
            "all_to_all": float(a2a_bytes),
            "ring": float(ring_bytes),
            "dp": float(dp_bytes if W > 1 else 0),
            "host": float(host_bytes),
        },
        peak_flops=dev.peak_flops * W,
        notes=notes,
    )


@dataclass(frozen=True)
class TimeSetup:
    """What ``estimate --time`` predicts with: the model's FLOP rates, the documents, the
    device kind, the efficiencies and the token budget."""

    rates: FlopRates
    docs: DocLengths
    device: DeviceKind
    efficiency: Efficiency
    budget: float

    def args(self) -> tuple[FlopRates, DocLengths, DeviceKind, Efficiency]:
        """:func:`step_time`'s arguments after the config and the estimate."""
        return self.rates, self.docs, self.device, self.efficiency

    def ranking_args(self) -> tuple[FlopRates, DocLengths, DeviceKind, Efficiency]:
        return self.args()
