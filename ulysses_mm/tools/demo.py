"""``ulysses-mm demo``: the whole flow on the sample data this repository ships.

1. ``prepare`` the mixed pipeline (DNA, speech, a video clip: small CC0 / public-domain
   files in tests/data, see its ATTRIBUTION.md) into 8,192-token samples;
2. ``train`` the debug model (configs/debug-tiny.yaml) at SP=2 on 2 CPU processes with
   W&B offline, checkpointing as it goes;
3. ``report`` the loss curves and ``inspect`` one packed sample as PNGs;

then print where the run, the checkpoint and the plots are. Every step is the same code
the CLI subcommands run.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.errors import NotFoundError

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "pipelines" / "mixed.yaml"
CONFIG = REPO / "configs" / "debug-tiny.yaml"


def run_demo(out: str = "build/demo", steps: int = 40, seq_len: int = 8192, nproc: int = 2) -> int:
    from ulysses_mm.shards.inspect import run_inspect
    from ulysses_mm.shards.prepare.run import load_pipeline_config, prepare
    from ulysses_mm.tools.report import plot
    from ulysses_mm.train.loop import run_train

    for needed in (PIPELINE, CONFIG, REPO / "tests" / "data"):
        if not needed.exists():
            raise NotFoundError(
                f"the demo runs from a clone of the repository; {needed} is missing"
            )
    out_dir = Path(out).resolve()
    shards = out_dir / "shards"
    t0 = time.perf_counter()
    print(f"[1/3] prepare {PIPELINE.relative_to(REPO)} -> {shards}")
    pipe = load_pipeline_config(PIPELINE, [f"output={shards}", f"pack.seq_len={seq_len}"])
    prepare(pipe)

    print(
        f"\n[2/3] train {CONFIG.relative_to(REPO)}: SP={nproc} on {nproc} CPU processes, {steps} steps"
    )
    cfg: RunConfig = load_config(
        RunConfig,
        CONFIG,
        [
            f"data.train={shards / 'manifest.json'}",
            f"train.out_dir={out_dir / 'run'}",
            f"train.steps={steps}",
            f"train.checkpoint_every={max(1, steps // 2)}",
            f"parallel.sp={nproc}",
            "logging.wandb=offline",
        ],
    )
    result = run_train(cfg, nproc, resume=False)

    print("\n[3/3] plots")
    run_dir = Path(result["run_dir"])
    loss_png = plot(run_dir, run_dir / "loss.png")
    sample_png = out_dir / "sample.png"
    pick = _most_mixed_sample(str(shards / "manifest.json"))
    run_inspect(str(shards / "manifest.json"), sample=pick, png=str(sample_png), out=io.StringIO())
    print(
        f"\ndemo done in {time.perf_counter() - t0:.0f} s; final loss {result['final_loss']:.3f}\n"
        f"  shards:     {shards}/manifest.json\n"
        f"  run:        {run_dir}  (metrics.jsonl)\n"
        f"  checkpoint: {result['checkpoint']}\n"
        f"  W&B (offline, `wandb sync` to upload): {result['wandb_dir']}\n"
        f"  loss plot:  {loss_png}\n"
        f"  sample:     {sample_png}  (sample {pick}, the most mixed)\n"
        f"next: ulysses-mm export {result['checkpoint']} {out_dir / 'hf'}"
    )
    return 0


def _most_mixed_sample(manifest_path: str) -> int:
    """The sample of the first shard with the most modalities, then the most documents."""
    from ulysses_mm.loader.stream import shard_samples
    from ulysses_mm.shards.manifest import Manifest, read_verified_shard

    m = Manifest.load(manifest_path)
    samples = shard_samples(read_verified_shard(m, 0), m.shard_location(0))
    best = max(samples, key=lambda s: (len(set(s.segments[:, 2].tolist())), len(s.segments)))
    return best.index
