"""The Hugging Face stack as a client: our shards as a dataset for Trainer / Accelerate,
our token space as a transformers tokenizer, our Ulysses × ring as a transformers
attention implementation.

- ``inputs.py``: the HF input convention (position ids per document, labels and
  shift_labels) and the one split of a batch over an SP group for our backend.
- ``attention.py``: :func:`register` (``attn_implementation="ulysses_mm"``) and
  :func:`isolate_documents` (our kernels as the core of another SP wrapper).
- ``dataset.py``: :class:`ShardDataset` (torch) and :func:`hf_dataset` (``datasets``).
- ``tokenizer.py``: ``ulysses-mm hf-tokenizer``.
- ``trainer.py``: the data state in Trainer checkpoints (imports transformers' Trainer).
- ``trl.py``: TRL's ``SFTTrainer`` on our shards (:func:`trl_dataset`, the guard rails and
  the data state in its checkpoints).
"""

from ulysses_mm.hf.attention import NAME, isolate_documents, register
from ulysses_mm.hf.dataset import ShardDataset, hf_dataset
from ulysses_mm.hf.inputs import document_ids, shard_inputs

__all__ = [
    "NAME",
    "ShardDataset",
    "document_ids",
    "hf_dataset",
    "isolate_documents",
    "register",
    "shard_inputs",
]
