"""The Hugging Face stack as a client: our shards as a dataset for Trainer / Accelerate,
our token space as a transformers tokenizer, our Ulysses × ring as a transformers
attention implementation.

- ``inputs.py``: the HF input convention (position ids per document, labels and
  shift_labels) and the one split of a batch over an SP group for our backend.
- ``attention.py``: :func:`register` (``attn_implementation="ulysses_mm"``) and
  :func:`isolate_documents` (our kernels as the core of another SP wrapper).
"""

from ulysses_mm.hf.attention import NAME, isolate_documents, register
from ulysses_mm.hf.inputs import document_ids, shard_inputs

__all__ = ["NAME", "document_ids", "isolate_documents", "register", "shard_inputs"]
