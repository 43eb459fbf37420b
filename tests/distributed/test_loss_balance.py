"""The loss's targets spread evenly over the SP group (``parallel.loss_balance``): every
rank of a sequence-parallel group peaks alike, and the loss and every gradient are those
of each rank computing its own targets.

A token space with a wide text head beside narrow ones, random packed multimodal samples
(documents of one modality or switching mid-way, the padded tail of the sample): without
the balance, the rank whose slice holds more text peaks higher. One gloo world of 4: SP=4,
and SP=2 × dp 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo import run_distributed
from torch.testing import assert_close

from ulysses_mm.config import ModelConfig
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.loader.synthetic import random_batch
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.parallel import Mesh, apply_loss_balance, apply_ulysses, loss_weights
from ulysses_mm.parallel.loss_balance import TargetBalance, received_targets, share_bounds
from ulysses_mm.parallel.slice import sp_slice
from ulysses_mm.tools.memory import TensorMemoryTracker
from ulysses_mm.train.step import forward_backward

VOCAB = {"text": 8192, "dna": 10, "audio": 256, "video": 256}
SPACE = TokenSpace.from_vocab(VOCAB)
CFG = ModelConfig(
    modalities=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    loss_tile_tokens=128,
)


def _step(mesh: Mesh, balance: bool, seq_len: int = 2048):
    """(peak bytes above the start, loss share, gradients) of one forward+backward."""
    model = build_model(CFG, SPACE, "sdpa_varlen", seed=3)
    apply_memory_policy(model, CFG)
    apply_ulysses(model, mesh)
    apply_loss_balance(model, mesh)
    assert isinstance(model.target_exchange, TargetBalance)
    if not balance:
        model.target_exchange = None
    batch = random_batch(SPACE, mesh.dp, seq_len, seed=1, max_doc=seq_len // 4)
    local = sp_slice(batch.rows(mesh.dp_rank, mesh.dp_rank + 1), mesh.sp_rank, mesh.sp)
    weights = loss_weights(SPACE.modalities, {})
    tracker = TensorMemoryTracker()
    tracker.track_module(model)
    tracker.track(vars(local).values())
    with tracker:
        start = tracker.live
        share, report = forward_backward(model, local, weights, mesh)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return tracker.peak - start, share, report, grads


def _peaks(mesh: Mesh, peak: int) -> list[int]:
    """Every rank's peak of this mesh's SP group."""
    out = [torch.zeros(1, dtype=torch.long) for _ in range(mesh.sp)]
    dist.all_gather(out, torch.tensor([peak]), group=mesh.sp_group)
    return [int(p) for p in out]


def _world(rank, world):
    results = {}
    for name, mesh in (("sp4", Mesh.build(4)), ("sp2", Mesh.build(2, 2))):
        peak0, share0, report0, grads0 = _step(mesh, balance=False)
        peak1, share1, report1, grads1 = _step(mesh, balance=True)
        # the same global loss and, summed over the world, every gradient
        assert abs(report1.total - report0.total) <= 1e-6 * abs(report0.total)
        assert report1.counts == report0.counts
        for d in (share0, share1):
            dist.all_reduce(d)
        assert_close(share1, share0, rtol=1e-6, atol=1e-7)
        for n in grads0:
            for g in (grads0[n], grads1[n]):
                dist.all_reduce(g)
            assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7, msg=n)
        results[name] = (_peaks(mesh, peak0), _peaks(mesh, peak1))
    return results


def test_every_rank_peaks_alike_and_computes_the_same_loss():
    for res in run_distributed(_world, 4, timeout=240):
        for name, (unbalanced, balanced) in res.items():
            # each rank computing its own targets: the text-heavy slice peaks higher
            assert max(unbalanced) > 1.05 * min(unbalanced), (name, unbalanced)
            assert max(balanced) <= 1.05 * min(balanced), (name, balanced)
            assert max(balanced) <= max(unbalanced), (name, balanced, unbalanced)


def test_shares_cover_every_target_once():
    # 3 ranks, 2 modalities: targets per rank [[5, 0], [1, 4], [0, 3]] -> each rank gets
    # 2 (±1) of modality 0 and 2 or 3 of modality 1; what rank j receives from each rank
    balance = TargetBalance(None, 3, 0, 2)
    every = torch.tensor([[5, 0], [1, 4], [0, 3]])
    got = received_targets(every, share_bounds(every.sum(0), 3))  # [dst, src, M]
    assert got.sum(1).tolist() == [[2, 2], [2, 2], [2, 3]]
    assert got.sum(0).tolist() == every.tolist()  # every target sent exactly once
    assert got[0].tolist() == [[2, 0], [0, 2], [0, 0]]
    m = torch.tensor([0, 0, 0, 0, 1, 1])
    place = balance._interleave(m)
    assert sorted(place.tolist()) == list(range(6))
    laid = torch.empty_like(m)
    laid[place] = m
    assert laid.tolist() == [0, 1, 0, 0, 1, 0]  # the two modalities spread over the rows
