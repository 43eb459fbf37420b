"""``ulysses-mm generate``: continue a prompt in one modality and write the file a person
opens — FASTA, WAV, MP4 (with the clip's audio when the spec interleaves it) or text.

1. The checkpoint (or export) gives the model, its token space and the tokenizer record
   of its training data (:mod:`ulysses_mm.train.inference`).
2. The prompt file goes through that modality's tokenizer exactly as ``prepare`` read its
   training data; ``--prompt-tokens`` / ``--prompt-seconds`` keep its beginning.
3. Sampling with a KV cache (:mod:`ulysses_mm.model.generate`), within the modality's
   head and the tokenizer's layout (:mod:`ulysses_mm.tokenize.grammar`), seeded.
4. The ids decode through the tokenizer into the file its kind writes
   (:meth:`Tokenizer.media <ulysses_mm.tokenize.base.Tokenizer.media>`).

With ``--nproc N`` (or under torchrun) the prompt is prefilled by N sequence-parallel
processes and the cache stays split over them (:mod:`ulysses_mm.parallel.decode`): for a
prompt longer than one device holds.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ulysses_mm.config.parse import check_flags, option
from ulysses_mm.core.checks import INT64_SAFE, MAX_PROCESSES, MAX_SEED, MAX_TOKENS
from ulysses_mm.core.errors import ConfigError, DataError, UnsupportedError, UserError
from ulysses_mm.core.layout import Layout
from ulysses_mm.core.tokenspace import DOC_END, DOC_START, TokenSpace
from ulysses_mm.model.generate import Decoder, Sampling, agree_local, generate
from ulysses_mm.model.kv_cache import CachedDecoder
from ulysses_mm.parallel import launch
from ulysses_mm.parallel.decode import SequenceParallelDecoder
from ulysses_mm.parallel.mesh import in_launched_world, open_world
from ulysses_mm.tokenize.base import Tokenizer
from ulysses_mm.tokenize.grammar import Grammar
from ulysses_mm.tokenize.write import write_file
from ulysses_mm.train.inference import Trained, open_trained
from ulysses_mm.train.plan import world_size
from ulysses_mm.train.step import build_inference_setup


@dataclass
class GenerateOptions:
    """``ulysses-mm generate``'s options (its flags, by :mod:`ulysses_mm.cli.declare`)."""

    modality: str = option("the modality to write (dna, audio, video, text, …)")
    new_tokens: int = option("ids to generate", ge=1, le=MAX_TOKENS, metavar="N")
    out: str = option("the file to write", path="out_file", metavar="FILE")
    prompt: str | None = option(
        "a file of that modality (FASTA, audio, video, .txt); none: start a document",
        None, path="in_file", metavar="FILE",
    )  # fmt: skip
    prompt_tokens: int | None = option(
        "keep the first N ids", None, ge=1, le=MAX_TOKENS, metavar="N", exclusive="prompt"
    )
    prompt_seconds: float | None = option(
        "keep the first S seconds (audio, video)", None, gt=0, le=10**6, metavar="S",
        exclusive="prompt",
    )  # fmt: skip
    temperature: float = option("softmax temperature (0: greedy)", 1.0, ge=0)
    top_k: int = option("sample among the k likeliest (0: all)", 0, ge=0, le=INT64_SAFE)
    top_p: float = option("nucleus: the likeliest ids of mass p (1: all)", 1.0, gt=0, le=1)
    seed: int = option("sampling seed", 0, ge=0, le=MAX_SEED)
    with_prompt: bool = option(
        "write the prompt's part too (default: only what was generated)", False
    )
    ignore_doc_end: bool = option(
        "never sample </doc>: write all --new-tokens ids (default: </doc> ends early)", False
    )
    tokenizer: str | None = option(
        "tokenizer spec to use instead of the one recorded with the model", None,
        path="in_file", metavar="SPEC",
    )  # fmt: skip
    dtype: str = option(
        "weights' dtype (auto: the training precision)", "auto",
        choices=("auto", "fp32", "bf16", "fp16"),
    )  # fmt: skip
    device: str = option("a GPU if any (auto)", "auto", choices=("auto", "cpu", "cuda"))
    nproc: int | None = option(
        "prefill with N local sequence-parallel processes (a prompt too long for one)", None,
        ge=1, le=MAX_PROCESSES,
    )  # fmt: skip

    def check(self) -> None:
        check_flags(self)  # the ranges the fields declare, as the command line checks them
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UnsupportedError("--device cuda: no CUDA device is visible here")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.seed)


def prompt_ids(
    tok: Tokenizer,
    space: TokenSpace,
    path: str | None,
    tokens: int | None = None,
    seconds: float | None = None,
) -> list[int]:
    """The prompt: ``<doc> <|m|>`` and the beginning of ``path``'s first document of the
    tokenizer's modality (all of it, ``tokens`` ids of it, or ``seconds`` of audio/video)."""
    m = tok.modality
    head = [DOC_START, space.boundary_token(m)]
    if path is None:
        return head
    if not Path(path).is_file():
        raise DataError(f"--prompt {path}: no such file")
    doc = next((d for d in tok.encode_file(path, space) if d.modality == m), None)
    if doc is None:
        raise DataError(f"--prompt {path}: the {tok.spec.name} tokenizer found no {m} in it")
    ids = [int(t) for t in np.asarray(doc.tokens).tolist()]
    if ids and ids[-1] == DOC_END:
        ids = ids[:-1]
    body = ids[2:]
    if tokens is not None:
        body = body[:tokens]
    elif seconds is not None:
        body = tok.prompt_ids_for_seconds(space, body, seconds)
    return ids[:2] + body


def _worker(payload: dict[str, Any], trained: Trained | None = None) -> dict[str, Any]:
    """One rank: the model (sequence-parallel over the launched world), the decode.
    ``trained``: what the parent opened, when it runs in the parent's process."""

    trained = trained or open_trained(payload["checkpoint"])
    opts = GenerateOptions(**payload["options"])
    cfg = replace(
        trained.cfg,
        parallel=replace(trained.cfg.parallel, sp=payload["world"], dp=1, ring=1),
    )
    device = None if opts.device == "auto" else opts.device
    place = open_world(cfg, deepspeed_comm=False, device=device)
    setup = build_inference_setup(
        cfg, trained.space, place, trained.load_into, trained.dtype(opts.dtype)
    )
    tok = trained.tokenizer(opts.modality, opts.tokenizer)
    prompt: list[int] = payload["prompt"]
    grammar = Grammar(tok, trained.space, end=not opts.ignore_doc_end)
    t0 = time.perf_counter()
    decoder: Decoder
    if place.mesh.sp > 1:
        sp = SequenceParallelDecoder(setup.model, place.mesh, len(prompt), opts.new_tokens)
        decoder, agree = sp, sp.agree
    else:
        decoder, agree = CachedDecoder(setup.model, len(prompt) + opts.new_tokens), agree_local
    with _prefill_progress(setup.model, place.mesh.rank == 0):
        result = generate(
            setup.model, decoder, grammar, prompt, opts.new_tokens, opts.sampling, agree
        )
    if place.device.type == "cuda":
        torch.cuda.synchronize(place.device)
    seconds = time.perf_counter() - t0
    return {
        "ids": result.ids,
        "sampled": result.sampled,
        "ended": result.ended,
        "seconds": seconds,
        "device": str(place.device),
    }


@contextlib.contextmanager
def _prefill_progress(model: Any, shown: bool) -> Iterator[None]:
    """A bar on stderr of the prompt's prefill, layer by layer (each layer's attention
    core is called once by a prefill, never by a step), shown when the prefill takes more
    than a second and cleared when it ends: a long prompt takes minutes."""
    if not shown:
        yield
        return

    layers = list(model.model.layers)
    bar = tqdm(total=len(layers), desc="prefill", unit="layer", leave=False, delay=1.0,
               file=sys.stderr)  # fmt: skip

    def done_one(*_: Any) -> None:
        bar.update(1)
        if bar.n >= len(layers):  # the prefill is done: the steps that follow show nothing
            bar.close()

    hooks = [layer.self_attn.core.register_forward_hook(done_one) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        bar.close()


def kv_cache_bytes(cfg: Any, tokens: int, itemsize: int) -> int:
    """Bytes of the keys and values of ``tokens`` positions: layers × 2 × kv heads × head
    dim × tokens × bytes per element (what :class:`~ulysses_mm.model.kv_cache.KVCache`
    allocates, split or not over the ranks)."""
    m = cfg.model
    return m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim * tokens * itemsize


def check_cache_fits(trained: Trained, opts: GenerateOptions, prompt: int, world: int) -> None:
    """Refuse, in one line, a prompt + ``--new-tokens`` whose KV cache is larger than the
    memory it would be allocated in (the free memory of the GPUs, or this host's available
    RAM) before anything is allocated."""

    itemsize = trained.dtype(opts.dtype).itemsize
    tokens = prompt + opts.new_tokens
    need = kv_cache_bytes(trained.cfg, tokens, itemsize)
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    if cuda:
        ranks = max(1, min(world, torch.cuda.device_count()))
        have, where = torch.cuda.mem_get_info()[0] * ranks, f"free on {ranks} GPU(s)"
    else:
        have, where = available_ram(), "of RAM available on this host"
    if need > have:
        per_token = need // tokens
        fits = max(0, have // per_token - prompt)
        raise ConfigError(
            f"--new-tokens {opts.new_tokens:,}: a KV cache of {prompt:,} + "
            f"{opts.new_tokens:,} tokens needs {_gib(need)}, more than the {_gib(have)} {where}"
            f" (at most about {fits:,} new tokens fit)"
        )


def available_ram() -> int:
    """Bytes of memory this host can still give (psutil's ``available``, else free pages)."""
    try:
        import psutil  # lazy: optional; without it, the free pages

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def generate_from_checkpoint(checkpoint: str, opts: GenerateOptions) -> dict[str, Any]:
    """Generate, decode and write ``opts.out``; returns what was done (for the CLI line)."""

    opts.check()
    if opts.nproc and in_launched_world():
        raise UserError("--nproc starts local processes; under torchrun leave it out")
    trained = open_trained(checkpoint)
    tok = trained.tokenizer(opts.modality, opts.tokenizer)
    prompt = prompt_ids(tok, trained.space, opts.prompt, opts.prompt_tokens, opts.prompt_seconds)
    world = world_size(opts.nproc)
    m = trained.cfg.model
    # one SP group over every process (the ranks' layout: sp = the world, dp 1, no ring)
    Layout(dp=1, sp=world).check(m.num_attention_heads, m.num_key_value_heads)
    check_cache_fits(trained, opts, len(prompt), world)
    payload = {
        "checkpoint": str(checkpoint),
        "options": asdict(opts),
        "prompt": prompt,
        "world": world,
    }
    if world > 1 and not in_launched_world():
        out = launch.run_world(_worker, opts.nproc, payload)[0]
    else:
        out = _worker(payload, trained)  # this process (one of a launched world's ranks)
        if int(os.environ.get("RANK", "0")) != 0:
            return {"out": "", "rank": int(os.environ["RANK"])}
    media = tok.media(trained.space, prompt, out["ids"], opts.with_prompt)
    if lacking := media.lacking():
        raise DataError(f"{len(out['ids'])} new ids hold {lacking}")
    description = _description(trained, opts, len(prompt), len(out["ids"]))
    path = write_file(opts.out, media.to_bytes("generated", description))
    return {
        "out": str(path),
        "what": media.describe(),
        "kind": media.suffix,
        "prompt_ids": len(prompt),
        "new_ids": len(out["ids"]),
        "sampled": out["sampled"],
        "ended": out["ended"],
        "seconds": out["seconds"],
        "tokens_per_s": len(out["ids"]) / max(out["seconds"], 1e-9),
        "device": out["device"],
        "processes": world,
    }


def _description(trained: Trained, opts: GenerateOptions, prompt: int, new: int) -> str:
    where = trained.path if trained.step is None else f"{trained.path} (step {trained.step})"
    source = f"{opts.prompt}" if opts.prompt else "no prompt"
    return (
        f"{new} ids after a {prompt}-id prompt ({source}) by {where}; seed {opts.seed}, "
        f"temperature {opts.temperature}, top-k {opts.top_k}, top-p {opts.top_p}"
    )
