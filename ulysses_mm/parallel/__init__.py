"""Distributed pieces: the mesh, Ulysses attention, the global loss. The model never
imports from here; :func:`apply_ulysses` and :func:`apply_loss_balance` are applied to a
built model."""

from ulysses_mm.parallel.comm import CommStats, Workspace
from ulysses_mm.parallel.loss import LossReport, global_loss, loss_weights
from ulysses_mm.parallel.loss_balance import apply_loss_balance
from ulysses_mm.parallel.mesh import Mesh, init_distributed
from ulysses_mm.parallel.ring import RingAttention
from ulysses_mm.parallel.slice import sp_slice, unmasked_pairs, zigzag_order
from ulysses_mm.parallel.ulysses import UlyssesAttention, apply_ulysses

__all__ = [
    "CommStats",
    "LossReport",
    "Mesh",
    "RingAttention",
    "UlyssesAttention",
    "Workspace",
    "apply_loss_balance",
    "apply_ulysses",
    "global_loss",
    "init_distributed",
    "loss_weights",
    "sp_slice",
    "unmasked_pairs",
    "zigzag_order",
]
