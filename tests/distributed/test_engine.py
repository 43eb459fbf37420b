"""The DeepSpeed engine under sequence parallelism: for every ZeRO stage the gradients the
optimizer sees at SP=2 (and dp=2 × sp=2) are those of one process on the same global batch,
gradient accumulation averages micro-steps, the optimizer offloaded to the host takes the
steps torch's AdamW takes, and the ds_config follows the run config."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.batch import Batch
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.parallel import Mesh, loss_weights
from ulysses_mm.parallel.mesh import open_world
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.train.engine import ds_config
from ulysses_mm.train.schedule import WarmupSchedule, lr_factor, lr_schedule
from ulysses_mm.train.step import Setup, build_setup, forward_backward, train_step

VOCAB = {"dna": 10, "audio": 32}
SPACE = TokenSpace.from_vocab(VOCAB)


def _cfg(stage: int, gas: int = 1) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            "model.modalities={dna: 10, audio: 32}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.loss_tile_tokens=64",
            f"deepspeed.zero_stage={stage}",
            f"deepspeed.gradient_accumulation_steps={gas}",
            "deepspeed.gradient_clipping=0.0",
            "deepspeed.scheduler.type=none",
            "deepspeed.optimizer.weight_decay=0.0",
        ],
    )


def _reference_grads(
    cfg: RunConfig, batches: list[Batch]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no DeepSpeed: mean over micro-batches of the global-batch loss."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    apply_memory_policy(model, cfg.model)
    w = loss_weights(model.space.modalities, {})
    totals = []
    for b in batches:
        _, report = forward_backward(model, b, w, Mesh.single(), scale=1 / len(batches))
        totals.append(report.total)
    return totals, {n: p.grad for n, p in model.named_parameters()}


def _engine_backward(engine, local: Batch, mesh: Mesh):
    """Forward this rank's slice through the engine, backward its share of the global
    loss (scaled so DeepSpeed's dp-average gives the global gradient); the loss report."""
    weights = loss_weights(engine.module.space.modalities, {})
    return forward_backward(engine, local, weights, mesh)[1]


def _setup(cfg: RunConfig, sp: int) -> Setup:
    """This rank's model → Ulysses → engine, as training builds it."""
    cfg.parallel.sp = sp
    space = TokenSpace.from_vocab(cfg.model.modalities)
    return build_setup(cfg, space, open_world(cfg, device="cpu"))


def _engine_grads(rank, world, sp, stages, gas):
    from deepspeed.utils import safe_get_full_grad

    results = {}
    # the terminal holds our lines only: torch's deprecation warnings on the collectives
    # ZeRO calls are filtered where the engine is built
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for stage in stages:
            cfg = _cfg(stage, gas)
            setup = _setup(cfg, sp)
            engine, mesh = setup.engine, setup.mesh
            micro = [random_batch(SPACE, mesh.dp, 128, seed=10 + k) for k in range(gas)]
            want_losses, want = _reference_grads(cfg, micro)
            got_losses = []
            for k, b in enumerate(micro):
                local = sp_slice(b.rows(mesh.dp_rank, mesh.dp_rank + 1), mesh.sp_rank, sp)
                report = _engine_backward(engine, local, mesh)
                got_losses.append(report.total)
                if k < gas - 1:
                    engine.step()  # not a boundary: accumulates
            for name, p in engine.module.named_parameters():
                g = safe_get_full_grad(p) if stage > 0 else p.grad
                assert_close(
                    g,
                    want[name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name, s=stage: f"ZeRO-{s} {n}: {m}",
                )
            assert got_losses == pytest.approx(want_losses, rel=1e-6)
            engine.step()
            results[stage] = got_losses
            engine.destroy()
    deprecated = [str(w.message) for w in seen if "torch.distributed." in str(w.message)]
    assert not deprecated, deprecated[:2]
    return results


@pytest.mark.parametrize(
    "world,sp,stages,gas",
    [
        pytest.param(2, 2, [0, 1, 2, 3], 1, id="sp2-zero0123"),
        pytest.param(4, 2, [2, 3], 2, id="dp2xsp2-zero23-gas2"),
    ],
)
def test_engine_gradients_match_one_process(world, sp, stages, gas):
    run_distributed(_engine_grads, world, sp, stages, gas, timeout=420)


def test_ds_config_follows_the_run_config():
    cfg = load_config(
        RunConfig,
        None,
        [
            "deepspeed.zero_stage=3",
            "deepspeed.precision=bf16",
            "deepspeed.offload_optimizer=cpu",
            "deepspeed.offload_param=cpu",
            "deepspeed.gradient_accumulation_steps=4",
            "deepspeed.gradient_clipping=0.5",
            "data.micro_batch_size=2",
            "train.steps=100",
            "deepspeed.scheduler.warmup_steps=7",
            "deepspeed.extra={zero_optimization: {stage3_max_live_parameters: 1000}}",
        ],
    )
    ds = ds_config(cfg, Mesh(Layout(dp=1, sp=4), rank=0))
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    z = ds["zero_optimization"]
    assert (
        z["stage"] == 3
        and z["offload_optimizer"] == {"device": "cpu"}
        and z["offload_param"] == {"device": "cpu"}
    )
    assert z["reduce_scatter"] is False and z["stage3_max_live_parameters"] == 1000
    assert ds["optimizer"]["params"]["torch_adam"] is False  # CPU offload needs DeepSpeed's Adam
    assert "scheduler" not in ds  # build_engine hands DeepSpeed the schedule itself
    sched = lr_schedule(cfg.deepspeed.scheduler, cfg.train.steps)(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    )
    assert sched.warmup == 7 and sched.total == 100 and sched.cosine
    with pytest.raises(ValueError, match="offload_param needs deepspeed.zero_stage=3"):
        ds_config(load_config(RunConfig, None, ["deepspeed.offload_param=cpu"]), Mesh.single())


def _offload_params(rank, world, steps, stages):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.utils import safe_get_full_fp32_param

    for stage in stages:
        cfg = _cfg(stage)
        cfg.deepspeed.offload_optimizer = "cpu"
        if stage == 3:
            cfg.deepspeed.offload_param = "cpu"
        ref = build_model(cfg.model, seed=cfg.train.seed)
        apply_memory_policy(ref, cfg.model)
        o = cfg.deepspeed.optimizer
        ref_opt = torch.optim.AdamW(
            ref.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        setup = _setup(cfg, world)  # sp = world
        engine, mesh = setup.engine, setup.mesh
        assert isinstance(setup.optimizer.optimizer, DeepSpeedCPUAdam), type(
            setup.optimizer.optimizer
        )
        w = loss_weights(SPACE.modalities, {})
        for step in range(steps):
            b = random_batch(SPACE, 1, 128, seed=100 + step)
            ref_opt.zero_grad()
            loss, _ = forward_backward(ref, b, w, Mesh.single())
            ref_opt.step()
            report = _engine_backward(engine, sp_slice(b, mesh.sp_rank, mesh.sp), mesh)
            assert report.total == pytest.approx(float(loss), rel=1e-5), (stage, step)
            engine.step()
        want = dict(ref.named_parameters())
        for name, p in engine.module.named_parameters():
            got = safe_get_full_fp32_param(p) if stage == 3 else p.detach()
            assert_close(got, want[name].detach(), rtol=1e-5, atol=1e-6, msg=f"ZeRO-{stage} {name}")
        engine.destroy()


def test_cpu_offload_adam_matches_torch_adamw_at_sp2():
    """The optimizer offloaded to the host (DeepSpeed's C++ CPUAdam) at SP=2 — ZeRO-2, and
    ZeRO-3 with the parameters offloaded too — takes the same steps as torch's AdamW in one
    process. The op is compiled here first (about a minute once, then cached in
    TORCH_EXTENSIONS_DIR) so no rank waits for the other's compilation inside a collective."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    run_distributed(_offload_params, 2, 3, [2, 3], timeout=420)


def _schedule_lrs(rank, world, kind):
    """The lr each step of a real DeepSpeed engine applies, and whether step 1 moved the
    weights."""
    cfg = load_config(
        RunConfig,
        None,
        [
            "model.modalities={dna: 10}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_hidden_layers=1",
            "deepspeed.optimizer.lr=0.01",
            f"deepspeed.scheduler.type={kind}",
            "deepspeed.scheduler.warmup_steps=4",
            "deepspeed.scheduler.min_lr_ratio=0.1",
            "train.steps=8",
        ],
    )
    setup = _setup(cfg, 1)
    params = setup.engine.module.parameters
    batch = random_batch(setup.space, 1, 64, seed=0)
    lrs, moved = [], []
    for _ in range(8):
        before = [p.detach().clone() for p in params()]
        lrs.append(setup.optimizer.param_groups[0]["lr"])  # what this step applies
        train_step(setup, [batch])
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, params())))
    return lrs, moved, setup.engine.lr_scheduler.state_dict()


@pytest.mark.parametrize("kind", ["WarmupCosineLR", "WarmupLR"])
def test_step_one_trains_and_warm_up_reaches_the_peak(kind):
    [(lrs, moved, state)] = run_distributed(_schedule_lrs, 1, kind, timeout=300)
    assert lrs[0] > 0 and all(moved)  # step 1 already changes the weights
    assert lrs[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert lrs[3] == 0.01  # the peak, exactly, at the end of warm-up
    if kind == "WarmupCosineLR":
        assert all(a > b for a, b in itertools.pairwise(lrs[3:]))
        assert lrs[7] == pytest.approx(0.001)  # min_lr_ratio × peak at train.steps
    else:
        assert lrs[4:] == [0.01] * 4
    assert state == {"steps": 8}


def test_schedule_factor_and_state():
    assert [lr_factor(k, 4, 8, 0.1, True) for k in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(8, 4, 8, 0.1, True) == pytest.approx(0.1)
    assert lr_factor(20, 4, 8, 0.1, True) == pytest.approx(0.1)  # past the end: the floor
    assert lr_factor(1, 0, 8, 0.1, False) == 1.0  # no warm-up: the peak from step 1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = WarmupSchedule(opt, 4, 8, 0.1, cosine=True)
    for _ in range(5):
        sched.step()
    again = WarmupSchedule(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), 4, 8, 0.1, True
    )
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr() == [2.0 * lr_factor(6, 4, 8, 0.1, True)]
    again.load_state_dict({"last_batch_iteration": 4})  # DeepSpeed's count, from -1
    assert again.steps == 5
