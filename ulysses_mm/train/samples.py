"""Samples of a model in training (``logging.samples``), and the W&B objects of an eval.

At an evaluation, rank 0 generates one document per modality whose tokenizer it can load
(``logging.sample_tokens`` ids after ``<doc> <|m|>``, with the KV cache of
:mod:`ulysses_mm.model.kv_cache`, fed token by token so that no attention core waits for
the other ranks), decodes it as ``ulysses-mm generate`` does and writes it under
``RUN_DIR/samples/step_N_<modality>.<ext>``; W&B gets each as audio, video or text. The
loss-by-position curves of the eval become one line chart.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ulysses_mm.core.tokenspace import DOC_START
from ulysses_mm.model.generate import Sampling, generate
from ulysses_mm.model.kv_cache import CachedDecoder
from ulysses_mm.model.llama import MultimodalLM
from ulysses_mm.tokenize.grammar import Grammar
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.tokenize.write import write_file
from ulysses_mm.train.metrics import LN2


@torch.no_grad()
def write_samples(
    model: MultimodalLM,
    tokenizers: TokenizerTable,
    out_dir: Path,
    step: int,
    new_tokens: int,
    seed: int,
) -> dict[str, tuple[str, Path]]:
    """Per modality: (how the file is shown: "text", "audio", "video", "file"; the file
    written); modalities whose tokenizer is not available are left out."""
    space = model.space
    out: dict[str, tuple[str, Path]] = {}
    for m in space.modalities:
        try:
            tok = tokenizers.tokenizer(m)
        except (LookupError, OSError, ValueError):
            continue
        prompt = [DOC_START, space.boundary_token(m)]
        decoder = CachedDecoder(model, len(prompt) + new_tokens, stepwise=True)
        sampling = Sampling(temperature=1.0, seed=seed + step)
        got = generate(model, decoder, Grammar(tok, space, end=False), prompt, new_tokens, sampling)
        media = tok.media(space, prompt, got.ids)
        if media.lacking():
            continue  # too few ids for a whole unit (a video frame)
        path = out_dir / f"step_{step:08d}_{m}.{media.suffix}"
        write_file(path, media.to_bytes(f"step_{step}_{m}", f"{len(got.ids)} ids at step {step}"))
        out[m] = (media.shown_as, path)
    return out


def wandb_media(
    samples: dict[str, tuple[str, Path]],
    position: Mapping[str, Sequence[Sequence[float]]] | None = None,
) -> dict[str, Any]:
    """W&B objects: each sample as audio, video or text; the loss-by-position curves of
    the eval (``{modality: [[lo, hi, nats, targets], ...]}``) as one line chart."""
    import wandb  # lazy: heavy (wandb)

    out: dict[str, Any] = {}
    for m, (shown_as, path) in samples.items():
        if shown_as == "audio":
            out[f"samples/{m}"] = wandb.Audio(str(path), caption=path.name)
        elif shown_as == "video":
            out[f"samples/{m}"] = wandb.Video(str(path), caption=path.name, format="mp4")
        elif shown_as == "text":
            text = path.read_text(errors="replace")
            out[f"samples/{m}"] = wandb.Html(f"<pre>{html.escape(text)}</pre>")
    if position:
        mods = sorted(position)
        out["eval/loss_by_position"] = wandb.plot.line_series(
            xs=[[(lo + hi - 1) / 2 for lo, hi, _, _ in position[m]] for m in mods],
            ys=[[v / LN2 for _, _, v, _ in position[m]] for m in mods],
            keys=mods,
            title="eval: bits per token against position in the document",
            xname="position",
        )
    return out
