"""A plain Accelerate training loop over ulysses-mm shards with our Ulysses × ring as the
model's attention (``attn_implementation="ulysses_mm"``).

    torchrun --nproc_per_node 4 examples/hf_accelerate_loop.py DATA/manifest.json OUT --sp 4 --ring 2
    torchrun --nproc_per_node 4 examples/hf_accelerate_loop.py DATA/manifest.json OUT --sp 4 --ring 2 --resume

The world is dp × sp; each SP group of sp = ulysses × ring ranks trains one sample at a
time: every rank of the group reads the same sample (``ShardDataset(reader=dp_rank)``
through torchdata's ``StatefulDataLoader``) and keeps its tokens
(:func:`~ulysses_mm.hf.shard_inputs`, the document zigzag when ring > 1). Each rank's loss
is its targets' cross-entropy sum over the global target count, times the world size,
because DDP averages gradients over the world: the step is then exactly the one-process
step on the same samples.

Checkpoints (``OUT/step-N``): the model as safetensors, the optimizer state loaded back
with ``weights_only=True``, and the dataloader's state (the dataset's inside it) as JSON.
Per-step losses go to ``OUT/losses.json`` (rank 0). CPU processes (gloo) or GPUs.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

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
    return model


def save(out: Path, step: int, model, optimizer, loader, rank0: bool) -> None:
    from safetensors.torch import save_file

    from ulysses_mm.core.storage import atomic_write_local

    where = out / f"step-{step}"
    if rank0:
        where.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()}, where / "model.safetensors"
        )
        torch.save(optimizer.state_dict(), where / "optimizer.pt")
        state = {"step": step, "loader": loader.state_dict()}
        atomic_write_local(where / "state.json", (json.dumps(state) + "\n").encode())
        atomic_write_local(out / "latest", f"step-{step}\n".encode())
    dist.barrier()


def load(out: Path, model, optimizer, loader) -> int:
    from safetensors.torch import load_file

    where = out / (out / "latest").read_text().strip()
    model.load_state_dict(load_file(where / "model.safetensors"))
    optimizer.load_state_dict(torch.load(where / "optimizer.pt", weights_only=True))
    state = json.loads((where / "state.json").read_text())
    loader.load_state_dict(state["loader"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="manifest.json (path or URL) of the training shards")
    p.add_argument("out", help="output directory (checkpoints, losses.json)")
    p.add_argument("--sp", type=int, default=4, help="sequence-parallel size (ulysses × ring)")
    p.add_argument("--ring", type=int, default=2, help="ring size R inside the SP group")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (constant)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per DP group per step")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ulysses_mm.config import DataConfig
    from ulysses_mm.core.format import IGNORE
    from ulysses_mm.hf import ShardDataset, register, shard_inputs
    from ulysses_mm.parallel import Mesh

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # DDP over gloo on CPU
    mesh = Mesh.build(args.sp, ring_size=args.ring)
    register(mesh)  # attn_implementation="ulysses_mm" now runs over this mesh
    dataset = ShardDataset(
        args.data, args.micro_batch, mesh.dp, mesh.dp_rank, DataConfig(seed=args.seed)
    )
    # torchdata calls torch.set_vital, which this torch deprecates: not ours to fix
    warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning, "torchdata")
    loader = StatefulDataLoader(dataset, batch_size=args.micro_batch)
    model = build_model(dataset.space.vocab_size, args.seed)
    model.set_attn_implementation("ulysses_mm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    out = Path(args.out)
    step = load(out, model, optimizer, loader) if args.resume else 0
    model, optimizer = accelerator.prepare(model, optimizer)
    losses_path = out / "losses.json"
    losses = json.loads(losses_path.read_text()) if args.resume and losses_path.exists() else {}
    losses = {k: v for k, v in losses.items() if int(k) <= step}  # a resumed run redoes the rest
    batches = iter(loader)
    while step < args.steps:
        batch = next(batches)
        inputs = {
            k: v.to(accelerator.device) if torch.is_tensor(v) else v
            for k, v in shard_inputs(batch, mesh).items()
        }
        count = (batch["shift_labels"] != IGNORE).sum()  # this DP group's targets
        dist.all_reduce(count, group=mesh.dp_group)  # ... of the whole global batch
        share = model(**inputs, num_items_in_batch=count).loss  # own targets' sum / count
        accelerator.backward(share * mesh.world_size)  # DDP averages over the world
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        loss = share.detach().clone()
        dist.all_reduce(loss)  # the shares add up to the global mean
        losses[str(step)] = float(loss)
        if step % args.save_every == 0 or step == args.steps:
            save(
                out,
                step,
                accelerator.unwrap_model(model),
                optimizer,
                loader,
                accelerator.is_main_process,
            )
    dataset.close()
    if accelerator.is_main_process:
        losses_path.write_text(json.dumps(losses, indent=1) + "\n")
    accelerator.end_training()  # leave the process group before the interpreter ends


if __name__ == "__main__":
    main()
