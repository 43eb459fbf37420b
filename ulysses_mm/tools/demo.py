"""``ulysses-mm demo``: the whole flow on the sample data this repository ships.

1. ``prepare`` the mixed pipeline (DNA, speech, a video clip: small CC0 / public-domain
   files in tests/data, see its ATTRIBUTION.md) into 8,192-token samples, with all four
   modalities: the sequences' FASTA/GenBank headers and features as text
   (``dna-annotated.json``, ``text-bytes.json``) and the clip's audio interleaved with its
   frames (``video-vq-av.json``);
2. ``train`` the debug model (configs/debug-tiny.yaml) at SP=2 on 2 CPU processes with
   W&B offline, checkpointing as it goes, evaluating at the end (on its training shards:
   the demo holds nothing out);
3. ``report`` the loss curves, ``inspect`` one packed sample and ``evaluate`` the loss by
   position as PNGs;

then print where the run, the checkpoint and the plots are, and the ``generate`` commands
that write a FASTA, WAV, MP4 and text file from it. Every step is the same code the CLI
subcommands run.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.errors import NotFoundError
from ulysses_mm.core.resources import resource, shipped_root
from ulysses_mm.core.storage import atomic_write_local
from ulysses_mm.shards.inspect import inspect_dataset
from ulysses_mm.shards.manifest import Manifest, read_verified_shard
from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
from ulysses_mm.tools.report import plot

PIPELINE = resource("pipelines/mixed.yaml")
CONFIG = resource("configs/debug-tiny.yaml")
# every modality: DNA with its headers as text, speech, the clip with its audio, text
TOKENIZERS = ("dna-annotated.json", "audio-mulaw-16k.json", "video-vq-av.json", "text-bytes.json")


def run_demo(
    out: str = "build/demo",
    steps: int = 40,
    seq_len: int = 8192,
    nproc: int = 2,
    eval_batches: int = 1_000_000,
    samples: int = 0,
) -> int:
    """The demo in ``out``; ``eval_batches`` caps what the training eval and ``evaluate``
    read (default: every sample); ``samples`` > 0 turns ``logging.samples`` on with that
    many ids per modality."""
    from ulysses_mm.tools.evaluate import (  # lazy: pulls torch
        EvaluateOptions,
        evaluate_checkpoint,
        plot_positions,
    )
    from ulysses_mm.train.loop import run_train  # lazy: pulls torch

    for needed in (PIPELINE, CONFIG, _DATA):
        if not needed.exists():
            raise NotFoundError(
                f"{needed} is missing: the demo needs the files the package ships "
                "(reinstall ulysses-mm, or run it from a clone)"
            )
    out_dir = Path(out).resolve()
    shards = out_dir / "shards"
    t0 = time.perf_counter()
    print(f"[1/3] prepare {PIPELINE.relative_to(shipped_root())} -> {shards}")
    specs = ",".join(str(resource("tokenizers") / t) for t in TOKENIZERS)
    pipe = load_pipeline_config(
        PIPELINE, [f"output={shards}", f"pack.seq_len={seq_len}", f"tokenizers=[{specs}]"]
    )
    prepare(pipe)

    print(
        f"\n[2/3] train {CONFIG.relative_to(shipped_root())}: SP={nproc} on {nproc} CPU processes, {steps} steps"
    )
    cfg: RunConfig = load_config(
        RunConfig,
        CONFIG,
        [
            f"data.train={shards / 'manifest.json'}",
            f"data.eval={shards / 'manifest.json'}",
            f"train.eval_every={steps}",
            f"train.eval_batches={eval_batches}",  # what `evaluate` reads below
            f"train.out_dir={out_dir / 'run'}",
            f"train.steps={steps}",
            f"train.checkpoint_every={max(1, steps // 2)}",
            f"parallel.sp={nproc}",
            "logging.wandb=offline",
            f"logging.samples={'true' if samples else 'false'}",
            f"logging.sample_tokens={samples or 1}",
        ],
    )
    shutil.rmtree(out_dir / "run", ignore_errors=True)  # the demo's own run: a fresh one each time
    result = run_train(cfg, nproc)

    print("\n[3/3] plots")
    run_dir = Path(result["run_dir"])
    loss_png = plot(run_dir, run_dir / "loss.png")
    sample_png = out_dir / "sample.png"
    pick = _most_mixed_sample(str(shards / "manifest.json"))
    inspect_dataset(
        str(shards / "manifest.json"), sample=pick, png=str(sample_png), out=io.StringIO()
    )
    position_png = run_dir / "loss_by_position.png"
    evaluated = evaluate_checkpoint(
        result["checkpoint"], str(shards / "manifest.json"), EvaluateOptions(batches=eval_batches)
    )
    plot_positions(evaluated, position_png, "demo: loss by position (its training shards)")
    atomic_write_local(
        position_png.with_suffix(".json"), json.dumps(evaluated.to_json(), indent=1).encode()
    )
    print(
        f"\ndemo done in {time.perf_counter() - t0:.0f} s; final loss {result['final_loss']:.3f}\n"
        f"  shards:     {shards}/manifest.json\n"
        f"  run:        {run_dir}  (metrics.jsonl)\n"
        f"  checkpoint: {result['checkpoint']}\n"
        f"  W&B (offline, `wandb sync` to upload): {result['wandb_dir']}\n"
        f"  loss plot:  {loss_png}\n"
        f"  sample:     {sample_png}  (sample {pick}, the most mixed)\n"
        f"  by position: {position_png} (figures: {position_png.with_suffix('.json').name})\n"
        f"next: ulysses-mm export {result['checkpoint']} {out_dir / 'hf'}\n"
        + "".join(
            f"      ulysses-mm generate {result['checkpoint']} --modality {m} {prompt}"
            f"--new-tokens {n} --ignore-doc-end --out {out_dir / ('generated.' + ext)}\n"
            for m, prompt, n, ext in _GENERATE
        )
    )
    return 0


_DATA = resource("tests/data")
# what to generate from the demo's checkpoint: (modality, prompt, new ids, file suffix)
_GENERATE = [
    ("dna", f"--prompt {_DATA / 'human_mt.fa'} --prompt-tokens 500 ", 1000, "fa"),
    ("audio", f"--prompt {_DATA / 'ljspeech_LJ001-0001.wav'} --prompt-seconds 1 ", 16000, "wav"),
    ("video", f"--prompt {_DATA / 'rabbit_toy_320x240.webm'} --prompt-seconds 1 ", 10000, "mp4"),
    ("text", "", 400, "txt"),
]


def _most_mixed_sample(manifest_path: str) -> int:
    """The sample of the first shard with the most modalities, then the most documents."""
    from ulysses_mm.loader.stream import shard_samples  # lazy: pulls torch

    m = Manifest.load(manifest_path)
    samples = shard_samples(read_verified_shard(m, 0), m.shard_location(0))
    best = max(samples, key=lambda s: (len(set(s.segments[:, 2].tolist())), len(s.segments)))
    return best.index
