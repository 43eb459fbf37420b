"""Generation speed: decoding with the KV cache against recomputing the whole prefix.

For each config (its model section; random weights, which speed does not depend on) and
each context length, a DNA document of that many ids is the prompt; the same sampling
loop (:func:`ulysses_mm.model.generate.generate`: grammar, head logits, seeded sampler)
then writes new ids with :class:`CachedDecoder` (one token through the layers per step,
attention over the cached keys) and with :class:`RecomputeDecoder` (the whole sequence
through the model per step). Both run side by side in one process; the ratio is the
cache's gain. The prefill (the prompt's one forward) is timed apart and not counted in
either rate.

    python benchmarks/bench_generate.py [--configs debug-tiny,small] [--contexts 2048,16384]
        [--new 64] [--recompute-new 4] [--device cpu|cuda] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.tokenspace import DEFAULT_MODALITIES, DOC_START, TokenSpace
from ulysses_mm.model import apply_memory_policy, build_model
from ulysses_mm.model.attention import PRECISION_DTYPES
from ulysses_mm.model.generate import Sampling, generate
from ulysses_mm.model.kv_cache import CachedDecoder, RecomputeDecoder
from ulysses_mm.tokenize.grammar import Grammar
from ulysses_mm.tokenize.registry import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: str, context: int, new: int, recompute_new: int, device, dtype) -> dict:
    cfg = load_config(RunConfig, REPO / "configs" / f"{config}.yaml", [])
    space = TokenSpace.from_vocab(cfg.model.modalities or DEFAULT_MODALITIES)
    model = build_model(cfg.model, space, seed=0)
    apply_memory_policy(model, cfg.model)  # as generation lays it out: layer tiles in prefill
    model.to(device=device, dtype=dtype).eval()
    dna = load_tokenizer(REPO / "tokenizers" / "dna-base.json")
    r = space.range("dna")
    g = torch.Generator().manual_seed(0)
    body = torch.randint(r.start, r.start + 4, (context - 2,), generator=g).tolist()
    prompt = [DOC_START, space.boundary_token("dna"), *body]
    out = {
        "config": config,
        "context": context,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    for name, decoder, n in (
        ("cached", CachedDecoder(model, context + new), new),
        ("recompute", RecomputeDecoder(model), recompute_new),
    ):
        timed = _Timed(decoder, device)
        _sync(device)
        t0 = time.perf_counter()
        got = generate(model, timed, Grammar(dna, space, end=False), prompt, n, Sampling(seed=1))
        _sync(device)
        total = time.perf_counter() - t0
        assert len(got.ids) == n
        out[f"{name}_prefill_s"] = timed.prefill_s
        # n - 1 steps through the model (the first id comes from the prefill's state)
        out[f"{name}_tok_s"] = (n - 1) / (total - timed.prefill_s)
    out["ratio"] = out["cached_tok_s"] / out["recompute_tok_s"]
    return out


class _Timed:
    """A decoder whose prefill (``start``) is timed apart."""

    def __init__(self, decoder, device: torch.device) -> None:
        self.decoder, self.device = decoder, device
        self.prefill_s = 0.0

    def start(self, input_ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        hidden = self.decoder.start(input_ids)
        _sync(self.device)
        self.prefill_s = time.perf_counter() - t0
        return hidden

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.step(input_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="debug-tiny,small")
    ap.add_argument("--contexts", default="2048,16384")
    ap.add_argument("--new", type=int, default=64, help="ids decoded with the cache")
    ap.add_argument("--recompute-new", type=int, default=4, help="ids decoded by recomputing")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(PRECISION_DTYPES), default="fp32")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a run of seconds (the smoke test)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.configs, args.contexts, args.new, args.recompute_new = "debug-tiny", "256", 8, 2
    if min(args.new, args.recompute_new) < 2:
        ap.error("--new and --recompute-new must be at least 2 (the first id needs no step)")
    device = torch.device(args.device)
    dtype = PRECISION_DTYPES[args.dtype]
    threads = torch.get_num_threads()
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{threads} threads'}), {args.dtype}"
    )
    print(
        f"{'config':<11} {'params':>7} {'context':>8} {'prefill s':>10} "
        f"{'cached tok/s':>13} {'recompute tok/s':>16} {'ratio':>7}"
    )
    rows = []
    for config in args.configs.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            r = measure(config, context, args.new, args.recompute_new, device, dtype)
            rows.append(r)
            print(
                f"{config:<11} {r['params_m']:>6.1f}M {context:>8,} {r['cached_prefill_s']:>10.2f} "
                f"{r['cached_tok_s']:>13.1f} {r['recompute_tok_s']:>16.2f} {r['ratio']:>6.1f}×",
                flush=True,
            )
    from _results import record

    line = " ".join(f"ratio_{r['config']}_{r['context']}={r['ratio']:.1f}" for r in rows)
    print(line)
    record(
        "bench_generate",
        {f"{r['config']}_{r['context']}": r for r in rows},
        smoke=args.smoke,
        gpu=device.type == "cuda",
    )


if __name__ == "__main__":
    main()
