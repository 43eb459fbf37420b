"""The memory modes change no number: checkpoints offloaded to the host
(``model.offload_checkpoints``), the sequence-tiled layer (``model.layer_tile_tokens``) and
the loss's tile gradients written into one buffer give the loss and every gradient of the
run without them — one process, and through the DeepSpeed engine on gloo at SP=1 and SP=2
(fp32)."""

from __future__ import annotations

import pytest
import torch
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ConfigError, ModelConfig, RunConfig, load_config
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import Offload, apply_memory_policy, build_model
from ulysses_mm.model.tiling import tile_map, tiles
from ulysses_mm.parallel import Mesh, loss_weights
from ulysses_mm.parallel.mesh import open_world
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.step import build_setup, forward_backward

VOCAB = {"dna": 16, "audio": 64, "video": 96}
SPACE = TokenSpace.from_vocab(VOCAB)
MODES = {
    "offload": dict(activation_checkpointing=True, offload_checkpoints=True),
    "layer-tiles": dict(layer_tile_tokens=20),
    "layer-tiles-ckpt": dict(activation_checkpointing=True, layer_tile_tokens=32),
    "all": dict(
        activation_checkpointing=True,
        offload_checkpoints=True,
        layer_tile_tokens=20,
        loss_tile_tokens=50,
    ),
}


def _grads(cfg: ModelConfig, batch):
    model = build_model(cfg, SPACE, seed=4)
    offload = apply_memory_policy(model, cfg, Offload())
    loss, _ = forward_backward(model, batch, loss_weights(SPACE.modalities, {}), Mesh.single())
    assert offload is None or offload.host.live == 0  # every host copy released by the end
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_modes_change_nothing_in_one_process(mode):
    batch = random_batch(SPACE, 2, 96, seed=3)
    base = dict(modalities=VOCAB, num_key_value_heads=2, num_hidden_layers=3)
    loss0, grads0 = _grads(ModelConfig(**base, loss_tile_tokens=100000), batch)
    loss1, grads1 = _grads(
        ModelConfig(**{"loss_tile_tokens": 100000, **base, **MODES[mode]}), batch
    )
    assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    for name in grads0:
        assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_offload_holds_every_layer_input_on_the_host_until_its_recompute():
    cfg = ModelConfig(modalities=VOCAB, num_hidden_layers=3, **MODES["offload"])
    model = build_model(cfg, SPACE, seed=0)
    offload = apply_memory_policy(model, cfg)
    assert offload is not None
    host = offload.host
    batch = random_batch(SPACE, 2, 40, seed=1)
    host.reset_peak()
    start = host.live
    hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids)
    x_bytes = 2 * 40 * cfg.hidden_size * 4
    # one [b, n, D] fp32 input per layer but the last, whose backward comes first
    assert host.live - start == 2 * x_bytes
    hidden.sum().backward()
    assert host.live == start and host.peak - start == 2 * x_bytes


class _Mark(torch.autograd.Function):
    """Identity whose backward logs ``what`` (when the gradient reaches it)."""

    @staticmethod
    def forward(ctx, x, log, what):
        ctx.log, ctx.what = log, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.what)
        return grad, None, None


class _LoggedCore(torch.nn.Module):
    """The layer's kernel, logging when its backward starts and ends."""

    def __init__(self, core, log, layer):
        super().__init__()
        self.core, self.log, self.layer = core, log, layer

    def forward(self, q, k, v, mask):
        q = _Mark.apply(q, self.log, ("attention backward done", self.layer))
        return _Mark.apply(self.core(q, k, v, mask), self.log, ("attention backward", self.layer))


@pytest.mark.parametrize("tiles", [0, 16], ids=["layer", "layer-tiles"])
def test_offload_fetches_the_previous_input_after_the_attention_backward(monkeypatch, tiles):
    """The previous layer's input comes back once the layer is past its attention
    backward (its high point), not while it runs; the result is unchanged."""
    from ulysses_mm.model.offload import HostCopy

    log: list = []
    prefetch = HostCopy.prefetch

    def logged(self):
        if self.fetched is None and self.host is not None:
            log.append(("fetch", self.layer))
        prefetch(self)

    monkeypatch.setattr(HostCopy, "prefetch", logged)
    cfg = ModelConfig(
        modalities=VOCAB, num_hidden_layers=3, layer_tile_tokens=tiles, **MODES["offload"]
    )
    model = build_model(cfg, SPACE, seed=0)
    apply_memory_policy(model, cfg)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.core = _LoggedCore(layer.self_attn.core, log, i)
    init = HostCopy.__init__

    def numbered(self, x, stream, keep=False, host=None):
        init(self, x, stream, keep, host)
        self.layer = sum(1 for e in log if e[0] == "copy")
        log.append(("copy", self.layer))

    monkeypatch.setattr(HostCopy, "__init__", numbered)
    batch = random_batch(SPACE, 2, 40, seed=1)
    model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids).sum().backward()
    order = [e for e in log if e[0] != "copy"]
    for j in (2, 1):  # layer j's backward fetches layer j - 1's input after its attention's
        assert order.index(("fetch", j - 1)) > order.index(("attention backward", j)), order
    assert ("fetch", 2) not in order  # the last layer's input never left the device


def test_tiles_hand_one_gradient_buffer_to_their_input():
    x = torch.randn(2, 10, 3, requires_grad=True)
    parts = tiles(x, 4)
    assert [p.shape[1] for p in parts] == [4, 4, 2]
    sum((i + 1) * p.sum() for i, p in enumerate(parts)).backward()
    want = torch.cat([torch.full((2, n, 3), float(i + 1)) for i, n in enumerate((4, 4, 2))], 1)
    assert_close(x.grad, want)
    y = torch.randn(2, 9, 3, requires_grad=True)
    out = tile_map(lambda a: (a * 2, a.sin()), 4, y)
    (out[0].sum() + out[1].sum()).backward()
    assert_close(y.grad, 2 + y.detach().cos())


def test_offload_needs_checkpointing():
    with pytest.raises(ConfigError, match="offload_checkpoints needs model.activation_check"):
        ModelConfig(offload_checkpoints=True)
    with pytest.raises(ConfigError, match="layer_tile_tokens must be >= 0"):
        ModelConfig(layer_tile_tokens=-1)


ENGINE_SPACE = TokenSpace.from_vocab({"dna": 10, "audio": 32})
SWITCHES = [
    "model.activation_checkpointing=true",
    "model.offload_checkpoints=true",
    "model.layer_tile_tokens=24",
]


def _engine_cfg(stage: int, sp: int, switches: list[str]) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            "model.modalities={dna: 10, audio: 32}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_key_value_heads=2",
            "model.loss_tile_tokens=40",
            f"deepspeed.zero_stage={stage}",
            "deepspeed.gradient_clipping=0.0",
            "deepspeed.scheduler.type=none",
            f"parallel.sp={sp}",
            *switches,
        ],
    )


def _engine_run(rank, world, stages):
    from deepspeed.utils import safe_get_full_grad

    batch = random_batch(ENGINE_SPACE, 1, 128, seed=7)
    for stage in stages:
        out = []
        for switches in ([], SWITCHES):
            cfg = _engine_cfg(stage, world, switches)
            setup = build_setup(cfg, ENGINE_SPACE, open_world(cfg, device="cpu"))
            local = sp_slice(batch, setup.mesh.sp_rank, world)
            loss, _ = forward_backward(setup.engine, local, setup.weights, setup.mesh)
            grads = {
                n: (safe_get_full_grad(p) if stage > 0 else p.grad).clone()
                for n, p in setup.engine.module.named_parameters()
            }
            out.append((loss.detach(), grads))
            setup.engine.destroy()
        (loss0, g0), (loss1, g1) = out
        assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
        for name in g0:
            assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=f"ZeRO-{stage} {name}")
    return True


@pytest.mark.parametrize("world,stages", [(1, [1]), (2, [2, 3])], ids=["sp1-zero1", "sp2-zero23"])
def test_modes_change_nothing_through_the_engine(world, stages):
    assert all(run_distributed(_engine_run, world, stages, timeout=420))


def test_bench_gpu_memory_modes_reach_the_plan():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for mode, offload, tile in (("none", False, 0), ("both", True, 8192), ("tiles", False, 8192)):
        args = bench.resolve(bench.build_parser().parse_args(["--memory-mode", mode]))
        cfg = bench.make_plan(args, n_gpus=1, gpu_mem_gib=80)["sp"][1]["cfg"]
        assert (cfg.model.offload_checkpoints, cfg.model.layer_tile_tokens) == (offload, tile)
    # --head-groups reaches the plan (and the estimate beside each point)
    args = bench.resolve(bench.build_parser().parse_args(["--head-groups", "4"]))
    assert bench.make_plan(args, n_gpus=1, gpu_mem_gib=80)["sp"][1]["cfg"].parallel.head_groups == 4
    # the shipped GPU config has both on; "none" fits a shorter sequence
    plans = {
        m: bench.make_plan(
            bench.resolve(bench.build_parser().parse_args(["--memory-mode", m])), 1, 80
        )["sp"][1]["estimated_max"]
        for m in ("config", "none")
    }
    assert plans["config"] > plans["none"] > 0
