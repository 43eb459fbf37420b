"""One output head per modality, and the sequence-tiled loss.

Each modality's head predicts over the shared specials plus its own id range: logits for
modality m are ``cat(special(h), head_m(h))``. The special projection is shared, so the
heads concatenated in token-id order (specials, then each range) are exactly one
``lm_head`` over the whole token space (what ``ulysses-mm export`` writes).

The loss never materialises ``[n, vocab]`` logits: tokens are processed in tiles of
``tile_tokens``, each tile recomputed in backward (activation checkpointing), and each
target goes through the head of its own modality only.

Every head is called on every tile, even with no token of its modality, so hooks that
gather parameters (ZeRO-3) fire identically on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ulysses_mm.core.errors import DataError
from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.tokenspace import TokenSpace
from ulysses_mm.model.tiling import tiles


class LossOutput(NamedTuple):
    """The loss terms of this process's targets, per modality M (in token-space order).
    They add up over processes: the global loss is their sums' ratio
    (:func:`ulysses_mm.parallel.global_loss`). A named tuple, so a training engine's
    output hooks reach its tensors."""

    ce_sum: Tensor  # [M] summed cross-entropy of the targets
    targets: Tensor  # [M] float32 count of targets
    ce_by_bin: Tensor | None = None  # [M, num_bins] ce_sum split by position bin (evaluation)
    # [M, num_bins] the binned targets the model's first guess (argmax) gets right
    hits_by_bin: Tensor | None = None


class ModalityHeads(nn.Module):
    def __init__(self, hidden_size: int, space: TokenSpace, tile_tokens: int = 8192) -> None:
        super().__init__()
        self.space = space
        self.tile_tokens = tile_tokens
        self.special = nn.Linear(hidden_size, space.num_specials, bias=False)
        self.heads = nn.ModuleDict(
            {r.name: nn.Linear(hidden_size, r.size, bias=False) for r in space.ranges}
        )

    def logits(self, hidden: Tensor, modality: str) -> Tensor:
        """[..., D] -> [..., specials + V_m]: modality m's head over its local vocabulary."""
        return torch.cat([self.special(hidden), self.heads[modality](hidden)], dim=-1)

    def lm_head_weight(self) -> Tensor:
        """All heads as one [vocab, D] matrix in token-id order."""
        weights: list[Tensor] = [self.special.weight]
        weights += [self.heads[r.name].weight for r in self.space.ranges]  # type: ignore[misc]
        return torch.cat(weights)

    def head_index(self, ids: Tensor, modality: str) -> Tensor:
        """Token ids (specials or ``modality``'s range) -> indices into its head's logits."""
        ns = self.space.num_specials
        return torch.where(ids < ns, ids, ids - self.space.range(modality).start + ns)

    def _head_ce(
        self, h: Tensor, labels: Tensor, mods: Tensor, reduction: str
    ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        # h [t, D], labels [t], mods [t] -> per modality (its tokens [t] bool, their CE,
        # whether the head's argmax is the target [k]: computed only when unreduced)
        for i, r in enumerate(self.space.ranges):
            sel = mods == i
            logits = self.logits(h[sel], r.name).float()  # [k, ns + V_m]
            target = self.head_index(labels[sel], r.name)
            ce = F.cross_entropy(logits, target, reduction=reduction)
            hit = logits.argmax(-1) == target if reduction == "none" else target.new_zeros(0)
            yield sel, ce, hit

    def _tile_loss(self, h: Tensor, labels: Tensor, mods: Tensor) -> Tensor:
        # -> [M] summed cross-entropy per modality
        return torch.stack([ce for _, ce, _ in self._head_ce(h, labels, mods, "sum")])

    def _tile_loss_by_bin(
        self, h: Tensor, labels: Tensor, mods: Tensor, bins: Tensor, num_bins: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        # as _tile_loss, and with bins [t] (-1: none) each modality's CE sum and count of
        # right first guesses per bin [M, B]
        sums, binned, hits = [], [], []
        for sel, ce, hit in self._head_ce(h, labels, mods, "none"):  # ce, hit [k]
            sums.append(ce.sum())
            b = bins[sel]
            keep = b >= 0
            binned.append(ce.new_zeros(num_bins).index_add_(0, b[keep], ce[keep]))
            hits.append(ce.new_zeros(num_bins).index_add_(0, b[keep], hit[keep].to(ce.dtype)))
        return torch.stack(sums), torch.stack(binned), torch.stack(hits)

    def loss_terms(
        self,
        hidden: Tensor,
        labels: Tensor,
        label_modality: Tensor,
        bins: Tensor | None = None,
        num_bins: int = 0,
    ) -> LossOutput:
        """hidden [b, n, D], labels [b, n] (IGNORE where no target), label_modality [b, n]
        (-1 where no target) -> the sum of CE per modality [M] and the target count per
        modality [M].

        With ``bins`` [b, n] (a bin index in ``[0, num_bins)`` per token, -1 for none: the
        target's position bin, for evaluation), also each modality's CE summed per bin
        [M, num_bins] (the same per-token cross-entropy the first sums add up) and how many
        of those targets the head's argmax predicts [M, num_bins]."""
        mods = torch.where(labels == IGNORE, torch.full_like(label_modality, -1), label_modality)
        h = hidden.reshape(-1, hidden.shape[-1])  # [b, n, D] -> [b*n, D]
        flat_labels, flat_mods = labels.reshape(-1), mods.reshape(-1)
        bad = (flat_mods >= 0) & ~self._in_vocab(flat_labels, flat_mods)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise DataError(
                f"target token {int(flat_labels[i])} is neither a special nor in the range of "
                f"modality {self.space.modalities[int(flat_mods[i])]!r}"
            )
        m = len(self.space.ranges)
        total = hidden.new_zeros(m, dtype=torch.float32)
        counts = torch.stack([(flat_mods == i).sum() for i in range(m)]).to(torch.float32)
        t = self.tile_tokens
        # the tiles' hidden-state gradients fill one buffer (no zero-padded [b*n, D] copy
        # per tile summed into a running one)
        parts = zip(tiles(h, t, 0), flat_labels.split(t), flat_mods.split(t), strict=True)
        if bins is None:
            for args in parts:
                if torch.is_grad_enabled():
                    total = total + checkpoint(self._tile_loss, *args, use_reentrant=False)
                else:
                    total = total + self._tile_loss(*args)
            return LossOutput(total, counts)
        by_bin = hidden.new_zeros(m, num_bins, dtype=torch.float32)
        hits = hidden.new_zeros(m, num_bins, dtype=torch.float32)
        for args, tile_bins in zip(parts, bins.reshape(-1).split(t), strict=True):
            sums, per_bin, right = self._tile_loss_by_bin(*args, tile_bins, num_bins)
            total, by_bin, hits = total + sums, by_bin + per_bin, hits + right
        return LossOutput(total, counts, by_bin, hits)

    def _in_vocab(self, labels: Tensor, mods: Tensor) -> Tensor:
        starts = torch.tensor([r.start for r in self.space.ranges], device=labels.device)
        stops = torch.tensor([r.stop for r in self.space.ranges], device=labels.device)
        m = mods.clamp(min=0)
        return (labels >= 0) & (
            (labels < self.space.num_specials) | ((labels >= starts[m]) & (labels < stops[m]))
        )
