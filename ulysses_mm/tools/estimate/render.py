"""The breakdown as text, what ``ulysses-mm estimate`` prints: the run in a few lines, the
per-GPU figures by kind, the terms at the peak, the total against the GPU's memory."""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.tools.estimate.result import Estimate
from ulysses_mm.tools.estimate.units import GiB, MiB, unit_for


@dataclass(frozen=True)
class _Row:
    """One figure per line, in the unit ``div`` of the table."""

    div: float

    def __call__(self, name: str, b: int | float, note: str = "", indent: int = 1) -> str:
        label = "  " * indent + name
        return f"{label:<64s}{b / self.div:9.2f}   {note}".rstrip()


def _replicated_for(est: Estimate) -> str:
    """The group the kv heads are replicated for (and the all-to-all runs over)."""
    step = est.step
    return f"ulysses={step.ulysses_size}" if step.ring_size > 1 else f"sp={step.sp}"


def _training(est: Estimate) -> list[str]:
    """The training line's items: precision, ZeRO, offloads, checkpointing, tiles, kernel."""
    act = est.act
    out = [est.precision, f"ZeRO-{est.zero_stage}"]
    if est.offload_optimizer != "none":
        out.append(f"optimizer offload to {est.offload_optimizer}")
    if est.offload_param != "none":
        out.append(f"parameter offload to {est.offload_param}")
    if est.activation_checkpointing:
        out.append("activation checkpointing")
    if est.offload_checkpoints:
        out.append("checkpoints offloaded to host")
    if act.layer_tile_tokens:
        out.append(f"layer tiles of {act.layer_tile_tokens:,}")
    elif act.mlp_tile_tokens:
        out.append(f"MLP tiles of {act.mlp_tile_tokens:,}")
    out.append(f"loss tiles of {act.loss_tile_tokens:,}")
    if est.step.head_groups > 1:
        out.append(f"attention in {est.step.head_groups} head groups")
    out.append(f"kernel {est.kernel}" + (" (CPU tensors)" if est.device == "cpu" else ""))
    return out


def _header(est: Estimate, unit: str) -> list[str]:
    """The run: model, tokens, world, training, then the table's head."""
    step, sh = est.step, est.shape
    e = sh.kv_expanded(step.ulysses_size)
    return [
        f"ulysses-mm estimate{': ' + est.config if est.config else ''}",
        f"model     {est.params / 1e9:.3f} B parameters: {sh.layers} layers, D {sh.hidden}, "
        f"MLP {sh.inter}, heads {sh.heads}/{sh.kv_heads} kv"
        + (f" (replicated to {e} for {_replicated_for(est)})" if e != sh.kv_heads else "")
        + f", head dim {sh.head_dim}",
        "tokens    "
        + ", ".join(f"{k} {v}" for k, v in est.space.items())
        + f" ({est.space_from}); widest head {sh.widest_head} logits",
        f"world     {step.gpus} GPU{'s' if step.gpus > 1 else ''} = dp {step.dp} × sp {step.sp}"
        + (f" (ulysses {step.ulysses_size} × ring {step.ring_size})" if step.ring_size > 1 else "")
        + "; "
        f"{step.seq_len:,} tokens per sample, {step.seq_len // step.sp:,} per GPU, micro-batch "
        f"{step.micro_batch}",
        "training  " + ", ".join(_training(est)),
        "",
        f"{'  per GPU':<64s}{unit:>9s}",
    ]


def _states_and_activations(est: Estimate, row: _Row, at: dict[str, int]) -> list[str]:
    """Parameters, gradients, optimizer states; one layer's activations and attention."""
    act, n, L = est.act, est.state_notes, est.shape.layers
    if act.layer_tile_tokens:
        recompute = act.tile_saved
    else:
        recompute = act.layer - (act.residual if est.precision == "fp32" else 0)
    offload_label = "kept, checkpoints offloaded to host" + (
        " (fetched + prefetched)" if est.offload_checkpoints else " (what-if)"
    )
    return [
        row("parameters", est.states["params"], n["params"]),
        row("gradients, at the peak", at.get("gradients", 0) + at.get("gradient partition", 0)),
        row("optimizer states", est.states["optimizer"], n["optimizer"]),
        f"  activations of one layer at {act.tokens:,} tokens",
        row("saved, without checkpointing", act.layer, f"× {L} = {act.layer * L / row.div:.2f}", 2),
        row(
            "kept, with checkpointing (the layer input)",
            act.residual,
            f"× {L} = {act.residual * L / row.div:.2f}",
            2,
        ),
        row(
            offload_label,
            2 * act.residual if est.offload_checkpoints else 0,
            f"host {est.host_checkpoints / row.div:.2f}",
            2,
        ),
        row("recomputed in backward, one layer at a time", recompute, indent=2),
        "  attention of one layer",
        row(
            "q, k, v after the all-to-all [b, s, hq/P + 2e/P, d]"
            if act.head_groups == 1
            else f"q, k, v of one head group of {act.head_groups} after the all-to-all",
            act.after_all_to_all,
            indent=2,
        ),
        row("forward working set", act.attention_forward, indent=2),
        row("backward working set", act.attention_backward, indent=2),
    ]


def _ring(est: Estimate, row: _Row) -> list[str]:
    """Ring attention's block scores and working sets (none without a ring)."""
    step, act = est.step, est.act
    if step.ring_size == 1:
        return []
    out = []
    n_r = step.seq_len // step.ring_size
    if act.ring_scores:
        out.append(
            row(
                f"ring block scores [{est.shape.heads // step.ulysses_size}, {n_r:,}, {n_r:,}] fp32 "
                "(per row)",
                act.ring_scores,
                "× 3 in forward, × 5 in backward",
                2,
            )
        )
    out += [
        row(
            "ring forward: K/V block + the one in flight, block kernel", act.ring_forward, indent=2
        ),
        row("ring backward: + dK/dV (fp32), dq, block gradients", act.ring_backward, indent=2),
    ]
    return out


def _tiles_and_buffers(est: Estimate, row: _Row, at: dict[str, int]) -> list[str]:
    """The MLP (or layer) tile and the loss tile; the communication buffers at the peak."""
    act = est.act
    if act.layer_tile_tokens:
        mlp = f"layer tile of {act.layer_tile_tokens:,} tokens, backward"
        mlp_bytes = act.tile_backward
    else:
        mlp = (
            f"MLP tile of {act.mlp_tile_tokens:,} tokens, backward"
            if act.mlp_tile_tokens
            else "MLP backward (no tiling)"
        )
        mlp_bytes = act.mlp_backward
    buffers = (
        at.get("DeepSpeed gradient buffers", 0)
        + at.get("DeepSpeed persistent buffers", 0)
        + at.get("gathered parameters", 0)
    )
    return [
        "  tiles",
        row(mlp, mlp_bytes, indent=2),
        row(
            f"loss tile of {act.loss_tile_tokens:,} tokens × {est.shape.widest_head} logits, "
            "backward",
            act.loss,
            indent=2,
        ),
        "  communication buffers",
        row(
            "all-to-all send + receive (one exchange of q, k, v)"
            if act.head_groups == 1
            else "all-to-all send + receive (a group's q, k, v, output gradient)",
            act.all_to_all,
            indent=2,
        ),
        row(
            "DeepSpeed buckets and gathered parameters, at the peak",
            buffers,
            est.state_notes["buffers"],
            2,
        ),
    ]


def _sent(est: Estimate) -> list[str]:
    """The bytes one rank sends per layer, forward and backward (none without SP)."""
    sent, step = est.sent_per_layer, est.step
    if not sent or step.sp == 1:
        return []
    out = ["  sent per rank per layer (forward / backward)"]
    rows = [("all_to_all", f"all-to-all over {_replicated_for(est).replace('=', ' ')}")]
    if step.ring_size > 1:
        rows.append(("ring", f"ring of {step.ring_size} (K/V blocks; backward + dK/dV)"))
    for key, label in rows:
        fwd, bwd = sent[f"{key}_forward"], sent[f"{key}_backward"]
        out.append(f"    {label:<60s}{fwd / MiB:9.2f} / {bwd / MiB:.2f} MiB")
    return out


def _peak_and_total(est: Estimate, row: _Row, unit: str) -> list[str]:
    """The terms at the peak, the GPU's headroom and reserve, the total and its verdict."""
    out = ["", f"  at the peak ({est.peak_phase})"]
    out += [row(t.name, t.bytes, indent=2) for t in est.phase(est.peak_phase).terms if t.bytes]
    out.append(row("tensor peak", est.peak))
    if est.device == "cuda":
        out.append(
            row(f"allocator headroom, {est.headroom_fraction:.0%} of the peak", est.headroom)
        )
        comms = est.step.communicators
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
            f"fits, {spare / row.div:.2f} {unit} spare"
            if spare >= 0
            else f"DOES NOT FIT, {-spare / row.div:.2f} {unit} over"
        )
    out.append(row("total", est.total, verdict))
    if est.offloaded_total is not None:
        out.append(row("total with checkpoints offloaded to host (what-if)", est.offloaded_total))
    if est.host:
        node = ""
        if est.host_mem is not None:
            node = (
                f"× {est.node_gpus} per node = {est.host_per_node / GiB:.2f} GiB of "
                f"{est.host_mem / GiB:g} GiB (--host-mem)"
            )
        out.append(row("host memory per GPU (offloaded states and checkpoints)", est.host, node))
    out += [f"  note: {x}" for x in est.notes]
    return out


def render(est: Estimate, all_phases: bool = False) -> str:
    """The breakdown as text (what ``ulysses-mm estimate`` prints); ``all_phases`` adds
    every phase's figure."""
    div, unit = unit_for(est.total)
    row = _Row(div)
    at = {t.name: t.bytes for t in est.phase(est.peak_phase).terms}
    out = _header(est, unit)
    out += _states_and_activations(est, row, at)
    out += _ring(est, row)
    out += _tiles_and_buffers(est, row, at)
    out += _sent(est)
    out += _peak_and_total(est, row, unit)
    if all_phases:
        out += ["", "  phases (tensors live at each high point)"]
        out += [row(p.name, p.bytes, indent=2) for p in est.phases]
    return "\n".join(out)
