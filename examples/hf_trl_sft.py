"""Train a transformers model on ulysses-mm shards with TRL's ``SFTTrainer`` and
Accelerate's sequence parallelism (DeepSpeed Ulysses, ZeRO-2).

    torchrun --nproc_per_node 2 examples/hf_trl_sft.py DATA/manifest.json OUT --sp 2
    accelerate launch --config_file sp2.yaml examples/hf_trl_sft.py DATA/manifest.json OUT

The second form takes the SP layout from the Accelerate config
(``parallelism_config: {parallelism_config_sp_size: 2, ...}``); ``--resume`` continues
from OUT's last checkpoint on either.

TRL's own recipe, plus what our shards need (``# ulysses-mm`` below): the stream as the
dataset ``SFTTrainer`` takes (:func:`~ulysses_mm.hf.trl.trl_dataset`, with each sample's
document lengths so TRL's collator restarts the positions at every document), its state
in every checkpoint and the checks of the ``SFTConfig``
(:func:`~ulysses_mm.hf.trl.sft_callbacks`), ``max_length=None`` (TRL would cut our
samples to 1,024 tokens) and ``ignore_data_skip=True`` (the dataset resumes from its own
state), and our document-isolating kernel as DeepSpeed's SDPA core
(:func:`~ulysses_mm.hf.isolate_documents`).

Per-step losses go to ``OUT/losses.json`` (rank 0), the train metrics to
``OUT/metrics.json``; checkpoints to ``OUT/checkpoint-N``. Runs on CPU processes (gloo)
as well as on GPUs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="manifest.json (path or URL) of the training shards")
    p.add_argument("out", help="output directory (checkpoints, losses.json)")
    p.add_argument(
        "--sp",
        type=int,
        default=0,
        help="sequence-parallel size given to SFTConfig (0: the accelerate launch config's)",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (constant)")
    p.add_argument("--zero", type=int, default=2, help="DeepSpeed ZeRO stage")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    args = p.parse_args(argv)

    import transformers
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from hf_trainer import build_model, deepspeed_config  # the sibling example
    from trl import SFTConfig, SFTTrainer

    from ulysses_mm.config import DataConfig
    from ulysses_mm.hf import isolate_documents
    from ulysses_mm.hf.tokenizer import build_tokenizer
    from ulysses_mm.hf.trainer import start_deepspeed, weights_only_checkpoints
    from ulysses_mm.hf.trl import sft_callbacks, shard_dataset, trl_dataset

    start_deepspeed()  # ulysses-mm: on CPU over gloo, nothing compiled (see hf_trainer.py)
    cpu = not torch.cuda.is_available()
    isolate_documents("sdpa")  # ulysses-mm: before Accelerate hands `sdpa` to DeepSpeed
    dataset = trl_dataset(args.data, data=DataConfig(seed=args.seed))  # ulysses-mm
    manifest = shard_dataset(dataset).stream.order.manifests[0]
    tokenizer = build_tokenizer(manifest.token_space, manifest.tokenizers)
    model = build_model(manifest.token_space.vocab_size, args.seed)
    parallelism = None
    if args.sp:
        parallelism = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=args.sp,
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length=manifest.seq_len,
                sp_seq_length_is_variable=False,
                sp_attn_implementation="sdpa",
            ),
        )
    config = SFTConfig(
        output_dir=args.out,
        max_length=None,  # ulysses-mm: our samples are packed already, at full length
        ignore_data_skip=True,  # ulysses-mm: the dataset resumes from its own state
        per_device_train_batch_size=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_steps=args.save_every,
        report_to=[],
        deepspeed=deepspeed_config(args.zero),
        parallelism_config=parallelism,
        activation_checkpointing=False,  # a tiny model
        bf16=not cpu,
        seed=args.seed,
        disable_tqdm=True,
        use_cpu=cpu,
    )
    # disable_tqdm does not reach the bar save_pretrained draws for each checkpoint
    transformers.utils.logging.disable_progress_bar()
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=sft_callbacks(dataset),  # ulysses-mm: data state, SFTConfig checks
    )
    with weights_only_checkpoints():
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    shard_dataset(dataset).close()
    trainer.accelerator.end_training()  # leave the process group before the interpreter ends
    if trainer.is_world_process_zero():
        history = trainer.state.log_history
        losses = {h["step"]: h["loss"] for h in history if "loss" in h}
        Path(args.out, "losses.json").write_text(json.dumps(losses, indent=1) + "\n")
        metrics = next(h for h in reversed(history) if "train_runtime" in h)
        Path(args.out, "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
