"""Ring attention over packed documents, the R axis of hybrid Ulysses × ring.

Every rank keeps its tokens in the document zigzag of
:func:`ulysses_mm.parallel.slice.ring_order` (causal load balance); after the Ulysses
all-to-all, ring rank j sees its N/R tokens on H/U heads and K/V blocks travel the ring.

- ``plan.py``: the varlen calls of each (query block, key block) pair (:class:`RingPlan`).
- ``kernels.py``: a block's calls forward and backward with their LSE (flash-attn's
  varlen calls, or an exact PyTorch kernel) and the LSE merge.
- ``attention.py``: the p2p ring, the autograd function, :class:`RingAttention`, and the
  bytes it sends (counted and in theory).

Dims: b batch, n = N/R tokens of this ring rank, h query heads here, hk kv heads here
(h % hk == 0: query head i reads kv head i // (h/hk)), d head dim; "flat" tensors are
[b·n, heads, d] and LSEs [b·n, heads].
"""

from ulysses_mm.parallel.ring.attention import RingAttention, new_ring_stats, ring_theory_bytes
from ulysses_mm.parallel.ring.kernels import (
    BlockKernel,
    FlashBlockKernel,
    TorchBlockKernel,
    block_forward,
    merge,
)
from ulysses_mm.parallel.ring.plan import RingPlan, VarlenCall, block_calls

__all__ = [
    "BlockKernel",
    "FlashBlockKernel",
    "RingAttention",
    "RingPlan",
    "TorchBlockKernel",
    "VarlenCall",
    "block_calls",
    "block_forward",
    "merge",
    "new_ring_stats",
    "ring_theory_bytes",
]
