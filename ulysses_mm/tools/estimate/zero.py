"""Parameters, gradients and optimizer states on one rank, as DeepSpeed's ZeRO lays them out.

ZeRO-0: torch AdamW, or for bf16/fp16 DeepSpeed's FP16_UnfusedOptimizer with an fp32
master copy. ZeRO-1/2: flat low-precision parameters, fp32 master and Adam m, v
partitioned, the gradient bucket(s) and for stage 2 the gradient partition. ZeRO-3: a
flat partition of everything, small tensors kept whole, the gradient partition and reduce
bucket, the parameters gathered in forward and backward. Offload moves optimizer states
(and ZeRO-3 parameters) to the host. DeepSpeed partitions over all dp × sp ranks (the
sequence-data-parallel group), and under sequence parallelism reduces gradients in fp32
(``seq_parallel_communication_data_type``): ZeRO-0/1/2 convert a bf16 bucket to an fp32
copy while reducing it, ZeRO-3's reduce bucket is fp32 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ulysses_mm.config import RunConfig
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.tools.estimate.shape import ModelShape

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


def _zero_settings(cfg: RunConfig, W: int, sp: int) -> dict[str, Any]:
    """The zero_optimization keys read here, as the engine's ds_config sets them for a
    world of ``W`` ranks in SP groups of ``sp`` (with ``deepspeed.extra`` merged), else
    DeepSpeed's defaults."""
    from ulysses_mm.parallel.mesh import Mesh  # lazy: imports torch
    from ulysses_mm.train.engine import ds_config  # lazy: imports torch

    mesh = Mesh(Layout(dp=W // sp, sp=sp), rank=0)
    zero = ds_config(cfg, mesh).get("zero_optimization", {})
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
    """One rank's states for a world of ``W`` ranks in SP groups of ``sp``: ``a`` bytes per
    parameter in the training precision; ``cuda``: the GPU's optimizer path (foreach)."""
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
        if ds.offload_optimizer != "none":
            # the flat gradient partition lives where the optimizer steps (DeepSpeed's
            # stage3 grad_partitions_flat_buffer on self.device, the host with offload)
            host += a * psi_r
            grad_partition = 0
        persistent = comm * rbs  # one reduce bucket, in the communication dtype
        if W > 1 or ds.offload_param != "none":
            # Gathered parameters (fetched from the host with parameter offload, on one
            # rank too) stay gathered while their reuse distance is short, up to
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
