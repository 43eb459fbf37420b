"""The tensors live on one rank at each phase of a training step whose high point can be
the peak: the last layer's forward (or, with checkpointing, its recomputation), the loss
and final norm backward, the last and first layer's backward, the gradient reduction and
the optimizer step.

With activation checkpointing a layer keeps only its input (D·a) and one layer is
recomputed at a time in backward. ``model.offload_checkpoints`` keeps those inputs in host
memory but the last layer's: on the device only the recomputed layer's input and, once
its attention's backward is done, the one fetched for the layer before it. The
sequence-tiled layer's backward holds one [T, D] gradient buffer per input (the input's,
the kernel output's) plus one recomputed tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.config import RunConfig
from ulysses_mm.tools.estimate.activations import Activations
from ulysses_mm.tools.estimate.shape import ModelShape
from ulysses_mm.tools.estimate.zero import ZeroStates


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


class _Step:
    """What every phase of one step reads: the states, the activations, and how the layers
    before the one at work keep theirs."""

    def __init__(
        self,
        cfg: RunConfig,
        sh: ModelShape,
        zs: ZeroStates,
        act: Activations,
        a: int,
        offload_checkpoints: bool,
    ) -> None:
        self.zs, self.act, self.a = zs, act, a
        self.L = sh.layers
        self.stage = cfg.deepspeed.zero_stage
        self.gas = cfg.deepspeed.gradient_accumulation_steps
        self.x = x = act.residual
        self.ckpt = ckpt = cfg.model.activation_checkpointing
        offload = ckpt and offload_checkpoints
        self.tiled = tiled = act.layer_tile_tokens > 0
        # stash: what the layers before the one at work keep
        self.per_layer = x if ckpt else (x + act.tile_saved if tiled else act.layer)
        self.stash_scale = 0 if offload else 1
        # offloaded: the last layer's input stays on the device; the one before a layer
        # is fetched once the layer is past its attention's backward
        self.kept = x if offload else 0
        self.prefetched = x if offload else 0
        if tiled:
            self.recompute = act.tile_saved
        else:
            self.recompute = act.layer - (
                x if a == 4 else 0
            )  # fp32: the first norm saves the input
        self.base = [
            Term("parameters", zs.params),
            Term("optimizer states", zs.optimizer),
            Term("gradient partition", zs.grad_partition),
            Term("DeepSpeed persistent buffers", zs.persistent),
        ]

    def grads(self, layers_done: int, reducing: bool) -> Term:
        # with gradient accumulation ZeRO-0/1 keep every gradient between micro-steps;
        # ZeRO-2's partition exists from the first bucket reduction on
        zs = self.zs
        g = zs.grads_full if self.gas > 1 else zs.grad_head + layers_done * zs.grad_layer
        return Term("gradients", g + (zs.grad_backward if reducing or self.gas > 1 else 0))

    def bwd(self, layers_done: int, reducing: bool = True) -> list[Term]:
        """Backward: ZeRO-2 reduces buckets as they fill, from the layers on (its
        communication-dtype copy counted at every layer); ZeRO-1 reduces at the end."""
        zs = self.zs
        reduce = zs.reduce if reducing and self.stage == 2 else 0
        return [
            *self.base,
            self.grads(layers_done, reducing),
            Term("DeepSpeed gradient buffers", zs.backward + reduce),
            Term("gathered parameters", zs.gathered),
            Term("batch, RoPE tables, document ids", self.act.fixed),
        ]

    def last_layer(self, part: str, working_set: str, live: int, layer_input: int) -> Phase:
        """The last layer's ``part`` at its high point, ``live`` bytes of ``working_set``:
        in forward, or recomputed in backward with checkpointing."""
        L, x, zs = self.L, self.x, self.zs
        if self.ckpt:
            inputs = (L - 1) * x * self.stash_scale + x
            return Phase(
                f"backward: recomputing the last layer's {part}",
                [
                    *self.bwd(0),
                    Term("checkpointed layer inputs", inputs),
                    Term("gradient of the residual stream", x),
                    Term(working_set, live - (x if self.a == 4 and not self.tiled else 0)),
                ],
            )
        return Phase(
            f"forward: the last layer's {part}",
            [
                *self.base,
                Term("gathered parameters", zs.gathered),
                Term("gradients", zs.grads_full if self.gas > 1 else 0),
                Term("batch, RoPE tables, document ids", self.act.fixed),
                Term("saved activations of the other layers", (L - 1) * self.per_layer),
                Term("layer input", layer_input),
                Term(working_set, live),
            ],
        )

    def last_attention(self) -> Phase:
        act, x = self.act, self.x
        if self.tiled:
            # (in head groups the caller's q, k, v are what the kernel keeps)
            qkv = act.qkv if self.a == 4 and act.head_groups == 1 else 0
            live = act.kernel_saved + act.attention_forward + qkv
        else:
            live = act.norm + act.kernel_saved + act.attention_forward
        layer_input = x if self.a != 4 or self.tiled else 0
        return self.last_layer("attention", "attention working set", live, layer_input)

    def last_mlp_tiles(self) -> Phase:
        act, x = self.act, self.x
        if self.tiled:  # the tiles after attention: their outputs, then their concatenation
            live = act.tile_saved + 2 * x + act.tile_forward
        else:
            live = 2 * act.norm + act.attention_saved + act.mlp_forward
        return self.last_layer("MLP tiles", "MLP working set", live, x if self.tiled else 0)

    def head(self) -> list[Phase]:
        """The loss tiles' and the final norm's backward, every layer's activations kept."""
        act = self.act
        kept = [
            *self.bwd(0, reducing=False),
            Term("saved activations", self.L * self.per_layer * self.stash_scale + self.kept),
            Term("final norm", act.final_norm),
        ]
        return [
            Phase(
                "backward: a loss tile",
                [*kept, Term("loss tile and the hidden states' gradient", act.loss)],
            ),
            Phase(
                "backward: the final norm",
                [*kept, Term("norm backward working set", act.final_norm_backward)],
            ),
        ]

    def layer(self, j: int, label: str) -> list[Phase]:
        """Layer ``j``'s backward, part by part (``label`` names it)."""
        act, x = self.act, self.x
        done = self.L - 1 - j  # layers whose gradients already exist
        before = j * self.per_layer * self.stash_scale + (x if self.ckpt else 0)
        fetched = self.prefetched if j else 0  # after the attention's backward
        this = self.recompute if self.ckpt else self.per_layer - (x if self.tiled else 0)
        common = [*self.bwd(done), Term("gradient of the residual stream", x)]
        # an offloaded layer's backward holds its output's gradient to the end
        held = [Term("gradient of the residual stream", x)] if self.prefetched else []
        if self.tiled:
            # the tiles after attention, backward: the input's and the kernel output's
            # gradient buffers fill; then the kernel's backward; then the tiles before it
            # (q, k, v gradients in, a second input-gradient buffer)
            return [
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
                        *self.bwd(done),
                        *held,
                        Term("saved activations", before + this - act.o),
                        Term("gradient buffer (input)", x),
                        Term("attention backward working set", act.attention_backward),
                    ],
                ),
                Phase(
                    f"backward: {label}'s tiles before attention",
                    [
                        *self.bwd(done),
                        *held,
                        Term("saved activations", before + fetched),
                        Term("q, k, v gradients", act.qkv),
                        Term("gradient buffers (input, twice)", 2 * x),
                        Term("tile backward working set", act.tile_backward),
                    ],
                ),
            ]
        return [
            Phase(
                f"backward: {label}'s MLP",
                [
                    *common,
                    Term("saved activations", before + this),
                    Term("MLP backward working set", act.mlp_backward),
                ],
            ),
            Phase(
                f"backward: {label}'s second norm",
                [
                    *common,
                    Term("saved activations", before + this - act.mlp_saved),
                    Term("norm backward working set", act.norm_backward),
                ],
            ),
            Phase(
                f"backward: {label}'s attention",
                [
                    *common,
                    Term("saved activations", before + this - act.mlp_saved - act.norm),
                    Term("attention backward working set", act.attention_backward),
                ],
            ),
        ]

    def after_backward(self) -> list[Phase]:
        """ZeRO-1's reduction and ZeRO-0's all-reduce at the end of backward, then the
        optimizer step."""
        zs, batch = self.zs, Term("batch", self.act.inputs)
        out = []
        if self.stage == 1:
            out.append(
                Phase(
                    "gradient reduction (end of backward)",
                    [
                        *self.base,
                        Term("gradients", zs.grads_full),
                        Term("DeepSpeed gradient buffers", zs.backward + zs.reduce),
                        batch,
                    ],
                )
            )
        if self.stage == 0:
            out.append(
                Phase(
                    "gradient all-reduce",
                    [
                        *self.base,
                        Term("gradients", zs.grads_full),
                        Term("DeepSpeed gradient buffers", zs.reduce),
                        batch,
                    ],
                )
            )
        out.append(
            Phase(
                "optimizer step",
                [
                    *self.base,
                    Term("gradients", zs.step_grads),
                    Term("optimizer step temporaries", zs.step_temp),
                    batch,
                ],
            )
        )
        return out


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
    if offload_checkpoints is None:
        offload_checkpoints = cfg.model.offload_checkpoints
    step = _Step(cfg, sh, zs, act, a, offload_checkpoints)
    out = [step.last_attention()]
    if act.mlp_tile_tokens or step.tiled:
        out.append(step.last_mlp_tiles())
    out += step.head()
    for j, label in ((sh.layers - 1, "the last layer"), (0, "the first layer")):
        out += step.layer(j, label)
    out += step.after_backward()
    return out
