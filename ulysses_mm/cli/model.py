"""Commands on a model: train it, look at what it learned, hand it on (demo, train,
export, generate, evaluate, report)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.config.parse import option, overrides, positional
from ulysses_mm.core.checks import MAX_PROCESSES
from ulysses_mm.train.stop import EXIT_STOPPED, StopRecord, young_interval_s

CHECKPOINT = "a run dir, its checkpoints/ dir or a step_* dir"


def _verbose() -> Any:
    return option(
        "also show DeepSpeed's log on the terminal (it always goes to the run's "
        "logs/deepspeed-rank-N.log)", False, flags=("-v", "--verbose"),
    )  # fmt: skip


def _log_to(verbose: bool) -> None:
    """DeepSpeed's log to the run's logs/ (``-v``: and the terminal), in every rank: they
    inherit the environment."""
    from ulysses_mm.parallel.mesh import DEEPSPEED_LOG_ENV  # lazy: torch

    os.environ[DEEPSPEED_LOG_ENV] = "run+terminal" if verbose else "run"


@dataclass
class Demo:
    """Prepare the repository's sample files (DNA, speech, video) with pipelines/mixed.yaml,
    train configs/debug-tiny.yaml at SP=2 on 2 CPU processes with W&B offline, and write
    the loss curves and one packed sample as PNGs."""

    out: str = option("output directory", "build/demo", path="out_dir")
    steps: int = option("training steps", 40, ge=1, le=10**6)
    verbose: bool = _verbose()

    def main(self) -> int:
        from ulysses_mm.tools.demo import run_demo  # lazy: torch

        _log_to(self.verbose)
        return run_demo(self.out, self.steps)


@dataclass
class Train:
    """Train the model of CONFIG on the shards its data.train manifest names. With --nproc
    N it starts N local processes itself; under torchrun or the DeepSpeed launcher it joins
    the world it is given."""

    config: str = positional(
        "run config YAML, or a shipped config's name (ulysses-mm configs)", "run_config"
    )
    overrides: list[str] = overrides()
    nproc: int | None = option(
        "start N local processes (torch elastic launcher)", None, ge=1, le=MAX_PROCESSES
    )
    resume: bool = option(
        "require a checkpoint to continue from (train.resume=always; the default, auto, "
        "continues when the run directory has one)", False,
    )  # fmt: skip
    max_minutes: float | None = option(
        "time budget (train.max_minutes): stop with a checkpoint, exit 75, before M minutes "
        "from now run out", None, ge=0, le=10**7, metavar="M",
    )  # fmt: skip
    verbose: bool = _verbose()

    def main(self) -> int:
        from ulysses_mm.tools.estimate.stages import check_stages_fit  # lazy: numpy
        from ulysses_mm.train.loop import run_train  # lazy: torch

        started = time.time()
        _log_to(self.verbose)
        extra = ["train.resume=always"] if self.resume else []
        extra += [f"train.max_minutes={self.max_minutes}"] if self.max_minutes is not None else []
        cfg = load_config(RunConfig, self.config, [*self.overrides, *extra])
        # the pre-flight checks every stage against train.gpu_mem_gib, before any process starts
        result = run_train(cfg, self.nproc, started, memory=check_stages_fit)
        if os.environ.get("RANK", "0") != "0":
            return 75 if result.get("stopped") else 0
        return _trained(result, cfg)


def _trained(result: dict, cfg: RunConfig) -> int:
    """What rank 0 prints when the run ends: complete, stopped (exit 75) or trained."""
    if result.get("complete"):
        print(
            f"the run in {result['run_dir']} is complete: step {result['steps']} of "
            f"{cfg.train.steps} ({result['checkpoint']}); raise train.steps to train on"
        )
        return 0
    if result.get("stopped"):
        record = StopRecord(**result["stopped"])
        print(f"ulysses-mm train: {record.line(_same_command())}", file=sys.stderr)
        return EXIT_STOPPED
    print(
        f"trained {result['steps']} steps; final loss {result['final_loss']:.4f}\n"
        f"  run dir:    {result['run_dir']}\n"
        f"  metrics:    {result['run_dir']}/metrics.jsonl\n"
        f"  checkpoint: {result['checkpoint']}\n"
        + (f"  wandb:      {result['wandb_dir']}\n" if result["wandb_dir"] else "")
        + _save_line(result, cfg.train.checkpoint_every)
    )
    return 0


def _same_command() -> str:
    """The command that continues a stopped run: this one, less what starts afresh."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "train":
        return "the same command (train.resume=auto)"
    fresh = ("train.resume=never", "train.resume=restart")
    return "ulysses-mm " + shlex.join(a for a in argv if a not in fresh)


def _save_line(result: dict, every: int) -> str:
    """The measured save time and Young's checkpoint interval for a failure a day."""
    save_s, step_s = result.get("save_s", 0.0), result.get("step_s", 0.0)
    if not save_s or not step_s:
        return ""
    cost = max(result.get("blocked_s", 0.0), 1e-3)  # what a save costs the run: its blocking part
    interval = young_interval_s(cost, 24 * 3600.0)
    return (
        f"  saves:      {cost:.2f} s blocking, {save_s:.2f} s to complete; Young's interval "
        f"for a failure a day: {interval / 60:.1f} min ≈ {interval / step_s:,.0f} steps "
        f"(train.checkpoint_every={every})\n"
    )


@dataclass
class Export:
    """Write a checkpoint as a transformers model (config.json + model.safetensors) that
    AutoModelForCausalLM.from_pretrained reads."""

    checkpoint: str = positional(CHECKPOINT, "in_dir")
    out: str = positional("output directory (config.json + model.safetensors)", "out_dir")

    def main(self) -> int:
        from ulysses_mm.train.export import export  # lazy: torch

        out = export(self.checkpoint, self.out)
        arch = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
        print(
            f"wrote a transformers {arch} checkpoint to {out} (AutoModelForCausalLM.from_pretrained)"
        )
        return 0


@dataclass
class Generate:
    """Tokenize PROMPT with the tokenizer the model's training data used, sample
    --new-tokens ids with a KV cache within the modality's head (and the tokenizer's
    layout: whole video frames, interleaved audio), and decode them to --out: FASTA for
    DNA, WAV for audio, MP4 for video (with the clip's audio when the spec interleaves it),
    UTF-8 text. The same seed gives the same output. --nproc N prefills a long prompt with
    N sequence-parallel processes."""

    checkpoint: str = positional("a run dir, a checkpoint (step_*) dir or an export dir", "in_dir")

    def main(self, opts: Any) -> int:
        from ulysses_mm.tools.generate import generate_from_checkpoint  # lazy: torch

        r = generate_from_checkpoint(self.checkpoint, opts)
        if r["out"]:
            print(
                f"wrote {r['out']}: {r['what']} ({r['kind']}); {r['new_ids']:,} new ids "
                f"({r['sampled']:,} sampled{', ended by </doc>' if r['ended'] else ''}) after "
                f"a {r['prompt_ids']:,}-id prompt; {r['tokens_per_s']:,.1f} ids/s with the "
                f"prefill, on {r['device']} × {r['processes']}"
            )
        return 0


@dataclass
class Evaluate:
    """Run MANIFEST's samples, in order, at full length or as windows of --seq-len tokens
    cut out of them, through the training step's forward under the run's sequence-parallel
    layout (or --sp): cross-entropy per modality in nats per token and in the units people
    quote (DNA bits per base, audio bits per sample, text bits per byte, video bits per
    frame), and against the target's position inside its document in log-spaced bins. The
    figures match the periodic eval of `ulysses-mm train` on the same batches."""

    checkpoint: str = positional(CHECKPOINT, "in_dir")
    manifest: str = positional("manifest.json of held-out shards (path or fsspec URL)", "in_path")
    json: bool = option("print every figure as JSON", False)
    png: str | None = option("plot loss against position", None, path="out_file", metavar="FILE")

    def main(self, opts: Any) -> int:
        from ulysses_mm.tools.evaluate import cli  # lazy: torch

        return cli(self.checkpoint, self.manifest, opts, self.json, self.png)


@dataclass
class Report:
    """Plot a run's loss curves per modality."""

    run_dir: str = positional("the run directory (train.out_dir)", "in_dir")
    png: str = option("where to write the plot", path="out_file")

    def main(self) -> int:
        from ulysses_mm.tools.report import plot  # lazy: matplotlib

        print(f"wrote {plot(self.run_dir, self.png)}")
        return 0
