"""Train a transformers model on ulysses-mm shards with the Transformers ``Trainer`` and
Accelerate's sequence parallelism (DeepSpeed Ulysses, ZeRO-2).

    torchrun --nproc_per_node 2 examples/hf_trainer.py DATA/manifest.json OUT --sp 2
    torchrun --nproc_per_node 2 examples/hf_trainer.py DATA/manifest.json OUT --sp 2 --resume

What runs is the HF stack as shipped: ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=2))`` makes Accelerate wrap the model's
``sdpa`` attention in DeepSpeed's ``UlyssesSPAttentionHF`` and the dataloader in
``UlyssesSPDataLoaderAdapter``, and the Trainer computes the loss across the SP group.
Two pieces are ours: the data (:class:`~ulysses_mm.hf.ShardDataset`, the whole stream that
Accelerate splits over the processes, with its state in every checkpoint), and the
attention kernel DeepSpeed calls on the gathered sequence: Accelerate accepts only
``sdpa`` or flash-attention as that core, and transformers' SDPA there attends across the
documents packed in a sample, so :func:`~ulysses_mm.hf.isolate_documents` makes ``sdpa``
our document-isolating kernel first (``--cross-documents`` leaves SDPA as it is).

Per-step losses go to ``OUT/losses.json`` (rank 0); checkpoints to ``OUT/checkpoint-N``.
Run on CPU processes (gloo) as well as on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def build_model(vocab_size: int, seed: int = 0):
    """A small Llama over the token space, the same on every process for a seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # use_cache=False: with a KV cache (the config's default, in training too) transformers
    # does not read packed documents from position_ids, and SDPA attends across them
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, use_cache=False, **SHAPE))
    model.set_attn_implementation("sdpa")
    return model


def deepspeed_config(zero_stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": zero_stage},
        # torch's AdamW inside DeepSpeed: no JIT-compiled optimizer op (CPU runs too)
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "steps_per_print": 1 << 30,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="manifest.json (path or URL) of the training shards")
    p.add_argument("out", help="output directory (checkpoints, losses.json)")
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size (1: no SP)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (constant)")
    p.add_argument("--zero", type=int, default=2, help="DeepSpeed ZeRO stage")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument(
        "--cross-documents",
        action="store_true",
        help="leave transformers' SDPA as DeepSpeed's core (packed documents then attend "
        "to each other)",
    )
    args = p.parse_args(argv)

    import transformers
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import Trainer, TrainingArguments

    from ulysses_mm.config import DataConfig
    from ulysses_mm.hf import ShardDataset, isolate_documents
    from ulysses_mm.hf.trainer import (
        ShardStateCallback,
        start_deepspeed,
        weights_only_checkpoints,
    )

    # DeepSpeed started as ulysses-mm train starts it: on CPU its communication over gloo
    # (Accelerate starts it only off the CPU; then use_cpu=True below), nothing compiled
    start_deepspeed()
    cpu = not torch.cuda.is_available()
    if not args.cross_documents:
        isolate_documents("sdpa")  # before Accelerate hands `sdpa` to DeepSpeed's Ulysses
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # the whole stream, split by Accelerate: one sample per process per dataloader step
    dataset = ShardDataset(args.data, 1, readers=world, data=DataConfig(seed=args.seed))
    model = build_model(dataset.space.vocab_size, args.seed)
    parallelism = None
    if args.sp > 1:
        parallelism = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=args.sp,
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length=dataset.stream.order.manifests[0].seq_len,
                sp_seq_length_is_variable=False,
                sp_attn_implementation="sdpa",
            ),
        )
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_steps=args.save_every,
        save_strategy="steps",
        report_to=[],
        deepspeed=deepspeed_config(args.zero),
        parallelism_config=parallelism,
        ignore_data_skip=True,  # the dataset resumes from its own state
        remove_unused_columns=False,
        seed=args.seed,
        disable_tqdm=True,
        use_cpu=cpu,
    )
    # disable_tqdm does not reach the bar save_pretrained draws for each checkpoint
    transformers.utils.logging.disable_progress_bar()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=dataset,
        callbacks=[ShardStateCallback(dataset)],
    )
    with weights_only_checkpoints():
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    dataset.close()
    trainer.accelerator.end_training()  # leave the process group before the interpreter ends
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        Path(args.out, "losses.json").write_text(json.dumps(losses, indent=1) + "\n")


if __name__ == "__main__":
    main()
