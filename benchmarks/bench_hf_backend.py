"""DeepSpeed's ``UlyssesSPAttentionHF`` vs ``attn_implementation="ulysses_mm"`` inside the
same transformers model (Llama, 8 query heads, 4 kv heads), side by side on gloo.

At SP=2 on 2 processes, for 8K and 16K tokens, one document and packed documents:
forward + backward of the whole model, loss = each rank's targets over the global count
(as both Trainer paths compute it). Printed per configuration and backend: tokens/s (both
backends in one world, steps interleaved, slowest rank, median), peak RSS per rank over
one step (each backend alone in a fresh world, the larger rank) and its rise, the loss,
and whether packed documents attend across each other (the logits of documents 1..
change when only document 0's tokens change). DeepSpeed gets what its adapter gives a rank
(contiguous tokens and position ids) and wraps transformers' SDPA, the core Accelerate
accepts on CPU; ours gets :func:`ulysses_mm.hf.shard_inputs`.

Then the largest SP each allows for a model with 4 kv heads: DeepSpeed's rule from its
code (heads % sp == 0, and kv % sp == 0 or sp % kv == 0), ours from
:func:`ulysses_mm.core.layout.valid_sp_sizes` (Ulysses × ring: only the Ulysses factor
divides the heads); with ``--probe 8`` a world of 8 processes tries sp=8 on a model of 4
heads and 4 kv heads with each (ours must match one process, per document).

    python benchmarks/bench_hf_backend.py [--seq-lens 8192 16384] [--steps 2] [--probe 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from ulysses_mm.core.format import IGNORE
from ulysses_mm.core.layout import valid_sp_sizes

MODEL = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    use_cache=False,
)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _model(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**MODEL, **over}))


def _sample(n: int, packed: bool, vocab: int, seed: int = 0):
    """input_ids, position_ids, shift_labels [1, n] and the document lengths: one document,
    or packed documents of 256 .. 2047 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n,), generator=g)
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(256, 2048, (1,), generator=g)) if packed else n)
    lengths[-1] = n - sum(lengths[:-1])
    pos = torch.cat([torch.arange(k) for k in lengths])
    targets = torch.full((n,), IGNORE)
    at = 0
    for k in lengths:
        targets[at : at + k - 1] = ids[at + 1 : at + k]
        at += k
    return ids[None], pos[None], targets[None], lengths


def _inputs(backend, mesh, ids, pos, targets):
    from ulysses_mm.hf import shard_inputs

    if backend == "ours":
        return shard_inputs({"input_ids": ids, "position_ids": pos, "shift_labels": targets}, mesh)
    # what DeepSpeed's UlyssesSPDataLoaderAdapter hands a rank: its contiguous tokens
    n = ids.shape[1] // mesh.sp
    sl = slice(mesh.sp_rank * n, (mesh.sp_rank + 1) * n)
    t = targets[:, sl].contiguous()
    return {"input_ids": ids[:, sl], "position_ids": pos[:, sl], "labels": t, "shift_labels": t}


def _setup(backend: str, mesh, n: int, model):
    if backend == "ours":
        from ulysses_mm.hf import register

        register(mesh)
        model.set_attn_implementation("ulysses_mm")
    else:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        model.set_attn_implementation("sdpa")
        UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", mesh.sp, 1, seq_length=n, seq_length_is_variable=False
        )


def _world():
    import deepspeed
    import torch.distributed as dist

    from ulysses_mm.parallel import Mesh
    from ulysses_mm.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return Mesh.build(dist.get_world_size())


def _step(model, inputs, count) -> float:
    import torch.distributed as dist

    share = model(**inputs, num_items_in_batch=count).loss
    share.backward()
    model.zero_grad(set_to_none=True)
    loss = share.detach().clone()
    dist.all_reduce(loss)  # the shares add up to the global mean
    return float(loss)


def _crosses(backend, model, mesh, ids, pos, targets, lengths) -> float:
    """Max |change| of the logits of documents 1.. when only document 0's tokens change."""
    import torch.distributed as dist

    with torch.no_grad():
        base = model(**_inputs(backend, mesh, ids, pos, targets)).logits
        other = ids.clone()
        other[0, : lengths[0]] = (other[0, : lengths[0]] + 1) % MODEL["vocab_size"]
        moved = model(**_inputs(backend, mesh, other, pos, targets)).logits
    delta = (base - moved).abs().amax(dim=-1)[0]  # this rank's tokens (contiguous: ring 1)
    n_local = ids.shape[1] // mesh.sp
    later = torch.arange(mesh.sp_rank * n_local, (mesh.sp_rank + 1) * n_local) >= lengths[0]
    value = torch.tensor(float(delta[later].max()) if later.any() else 0.0)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timing_worker(n: int, packed: bool, steps: int, warmup: int) -> dict:
    """Both backends in one world, steps interleaved (so load drift hits both alike)."""
    import torch.distributed as dist

    mesh = _world()
    ids, pos, targets, lengths = _sample(n, packed, MODEL["vocab_size"])
    count = (targets != IGNORE).sum()
    models, inputs = {}, {}
    for backend in ("deepspeed", "ours"):
        models[backend] = _model()
        _setup(backend, mesh, n, models[backend])
        inputs[backend] = _inputs(backend, mesh, ids, pos, targets)
    times: dict[str, list[float]] = {"deepspeed": [], "ours": []}
    loss = {}
    for i in range(warmup + steps):
        for backend in ("ours", "deepspeed") if i % 2 else ("deepspeed", "ours"):
            dist.barrier()
            t0 = time.perf_counter()
            loss[backend] = _step(models[backend], inputs[backend], count)
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank
            if i >= warmup:
                times[backend].append(float(dt))
    out = {"docs": len(lengths)}
    for backend, model in models.items():
        cross = float("nan")
        if len(lengths) > 1:
            cross = _crosses(backend, model, mesh, ids, pos, targets, lengths)
        out[backend] = {
            "tokens_per_s": n / statistics.median(times[backend]),
            "loss": loss[backend],
            "cross": cross,
        }
    return out


def memory_worker(backend: str, n: int, packed: bool) -> dict:
    """One backend alone in a fresh world: peak RSS over one step, and its rise."""
    import torch.distributed as dist

    mesh = _world()
    model = _model()
    _setup(backend, mesh, n, model)
    ids, pos, targets, _ = _sample(n, packed, MODEL["vocab_size"])
    inputs = _inputs(backend, mesh, ids, pos, targets)
    before = _rss_mib()
    _step(model, inputs, (targets != IGNORE).sum())
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    rise = torch.tensor(float(peak) - before)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    return {"peak_mib": float(peak), "rise_mib": float(rise)}


def probe(sp: int) -> dict:
    """sp ranks, a model of 4 heads and 4 kv heads: DeepSpeed's registration, and ours
    (Ulysses 4 × ring sp/4) against one process run per document."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from ulysses_mm.hf import register, shard_inputs
    from ulysses_mm.parallel import Mesh

    _world()
    shape = dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=128, head_dim=32)
    n = 64 * sp
    ids, pos, targets, lengths = _sample(n, True, MODEL["vocab_size"], seed=1)
    # the reference first: a registration DeepSpeed accepts replaces `sdpa` for every model
    ref = _model(**shape)
    ref.set_attn_implementation("sdpa")
    total, at = torch.zeros(()), 0
    with torch.no_grad():
        for k in lengths:
            logits = ref(input_ids=ids[:, at : at + k], position_ids=pos[:, at : at + k]).logits
            total += torch.nn.functional.cross_entropy(
                logits[0], targets[0, at : at + k], ignore_index=IGNORE, reduction="sum"
            )
            at += k
    want = float(total / (targets != IGNORE).sum())
    out: dict = {}
    try:
        model = _model(**shape)
        model.set_attn_implementation("sdpa")
        UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", sp, 1, seq_length=n, seq_length_is_variable=False
        )
        out["deepspeed"] = "ran"
    except Exception as e:  # what DeepSpeed says about this layout
        out["deepspeed"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    mesh = Mesh.build(sp, ring_size=sp // 4)
    register(mesh)
    model = _model(**shape)
    model.set_attn_implementation("ulysses_mm")
    inputs = shard_inputs({"input_ids": ids, "position_ids": pos, "shift_labels": targets}, mesh)
    with torch.no_grad():
        share = model(**inputs, num_items_in_batch=(targets != IGNORE).sum()).loss
    dist.all_reduce(share)
    out["ours"] = (
        f"ran at sp={sp} = ulysses 4 × ring {sp // 4}: loss {float(share):.6f}, one process per document {want:.6f}"
    )
    out["ours_matches"] = abs(float(share) - want) < 1e-5
    return out


def ds_sizes(heads: int, kv: int, seq_len: int) -> list[int]:
    """SP sizes DeepSpeed accepts: UlyssesSPAttentionHF.__init__'s two head checks, and
    UlyssesSPDataLoaderAdapter's seqlen % sp == 0."""
    return [
        p
        for p in range(1, heads + 1)
        if heads % p == 0 and (kv % p == 0 or p % kv == 0) and seq_len % p == 0
    ]


def our_largest(heads: int, seq_len: int) -> tuple[int, int]:
    """The largest sp = ulysses × ring we accept (over rings of powers of two), and its ring."""
    best = (1, 1)
    r = 2
    while 2 * r <= seq_len:
        sizes = valid_sp_sizes(heads, seq_len, ring=r)
        if sizes and max(sizes) > best[0]:
            best = (max(sizes), r)
        r *= 2
    return best


def main() -> None:
    from ulysses_mm.parallel.launch import launch_local

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384], help="tokens N")
    ap.add_argument("--steps", type=int, default=2, help="timed fwd+bwd steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--probe", type=int, default=0, help="also try this sp on 4 heads (0: no)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:  # one short packed sample, timed only (no fresh worlds for memory)
        args.seq_lens, args.steps, args.warmup = [512], 1, 0
    figures = {}
    m = MODEL
    print(
        f"transformers Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} kv heads, head dim "
        f"{m['head_dim']}), fp32, SP=2 on 2 CPU processes (gloo), fwd+bwd of the whole model"
    )
    print(
        f"{'N':>6} {'data':>7} {'backend':>10} {'tokens/s':>9} {'peak RSS MiB':>13} "
        f"{'rise MiB':>9} {'loss':>9} {'crosses docs':>13}"
    )
    for n in args.seq_lens:
        for packed in (True,) if args.smoke else (False, True):
            res = launch_local(timing_worker, 2, n, packed, args.steps, args.warmup)[0]
            for b in ("deepspeed", "ours"):
                if args.smoke:
                    res[b].update(peak_mib=float("nan"), rise_mib=float("nan"))
                else:
                    res[b].update(launch_local(memory_worker, 2, b, n, packed)[0])
            for b in ("deepspeed", "ours"):
                r = res[b]
                cross = "-" if r["cross"] != r["cross"] else ("yes" if r["cross"] > 0 else "no")
                cross += f" ({r['cross']:.1e})" if cross != "-" else ""
                data = f"{res['docs']} docs" if packed else "1 doc"
                print(
                    f"{n:>6} {data:>7} {b:>10} {r['tokens_per_s']:>9.0f} {r['peak_mib']:>13.0f} "
                    f"{r['rise_mib']:>9.0f} {r['loss']:>9.5f} {cross:>13}",
                    flush=True,
                )
            o, d = res["ours"], res["deepspeed"]
            key = f"n{n}_{'packed' if packed else 'one_doc'}"
            figures[f"{key}_tokens_s_ratio"] = o["tokens_per_s"] / d["tokens_per_s"]
            figures[f"{key}_peak_ratio"] = o["peak_mib"] / d["peak_mib"]
            figures[f"{key}_ours_crosses"] = o["cross"]
            print(
                f"{'':>6} {'':>7} {'ours/DS':>10} {o['tokens_per_s'] / d['tokens_per_s']:>9.2f} "
                f"{o['peak_mib'] / d['peak_mib']:>13.2f} {o['rise_mib'] / max(d['rise_mib'], 1):>9.2f}",
                flush=True,
            )
    print("tokens/s: N / the slowest rank's median step, both backends in one world, steps")
    print("interleaved; peak RSS: the larger rank's ru_maxrss over one step, each backend alone")
    print("in a fresh world; rise: its growth over the RSS before the step; crosses docs: max")
    print("|change| of later documents' logits when only document 0's tokens change (0 = isolated)")
    print("\nLargest SP for a model with 4 kv heads (DeepSpeed: its checks; ours: valid_sp_sizes)")
    for name, heads, kv in (("this model", 8, 4), ("Qwen2.5-7B shape", 28, 4)):
        for n in args.seq_lens:
            ds = ds_sizes(heads, kv, n)
            ulysses = valid_sp_sizes(heads, n)
            largest, ring = our_largest(heads, n)
            print(
                f"  {name} ({heads} heads / {kv} kv), N={n}: DeepSpeed {ds} (max {max(ds)}); "
                f"ours: Ulysses alone {ulysses}; Ulysses × ring: sp = U × R with U dividing "
                f"the heads and 2·sp the sequence, the largest searched sp={largest} "
                f"(= {largest // ring} × ring {ring}, {n // largest} tokens per rank)"
            )
    if args.probe:
        res = launch_local(probe, args.probe, args.probe)[0]
        print(f"\nsp={args.probe}, 4 heads / 4 kv heads, world of {args.probe} processes:")
        print(f"  DeepSpeed: {res['deepspeed']}")
        print(f"  ours: {res['ours']} (match: {res['ours_matches']})")
    from _results import record

    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    record("bench_hf_backend", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
