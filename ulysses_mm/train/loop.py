"""``ulysses-mm train``: stream shards into a DeepSpeed Ulysses run.

Per optimizer step, each DP group reads its micro-batches, every SP rank keeps its slice,
the engine runs forward (per-modality CE sums and counts), the loss share is reduced to a
token-weighted mean over dp × sp and back-propagated, and the engine steps. Rank 0 logs,
evaluates on held-out shards every ``train.eval_every`` steps, and every rank takes part in
checkpoints every ``train.checkpoint_every`` steps and at the end.

At every step boundary the ranks agree (:func:`~ulysses_mm.train.stop.agree`, one small
all-reduce) on whether a signal or the time budget stops the run and whether every rank's
background checkpoint writes are done; a stop saves the last completed step and returns a
result the CLI turns into one line and exit 75.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ulysses_mm.config import RunConfig, Stage, from_dict, run_stages, stage_of, to_dict
from ulysses_mm.core.errors import Interrupted, UserError, WorkerError
from ulysses_mm.core.layout import Layout
from ulysses_mm.loader.balance import Work
from ulysses_mm.loader.batch import Batch, samples_batch
from ulysses_mm.loader.fetch import FetchInterrupted
from ulysses_mm.loader.node_cache import NodeCache
from ulysses_mm.loader.order import Sources
from ulysses_mm.loader.stream import ShardStream, StreamOptions
from ulysses_mm.loader.window import WindowStream
from ulysses_mm.parallel import launch
from ulysses_mm.parallel.mesh import Mesh, close_world, in_launched_world, open_world
from ulysses_mm.tokenize.table import TokenizerTable
from ulysses_mm.train import checkpoint
from ulysses_mm.train.evaluate import EvalResult, evaluate_batches, units_for
from ulysses_mm.train.flops import causal_pairs, pairs_per_token, peak_tflops, train_flops
from ulysses_mm.train.logger import MetricsLogger
from ulysses_mm.train.metrics import ModalitySums, peak_memory_mb
from ulysses_mm.train.plan import (
    MemoryCheck,
    RunPlan,
    plan_run,
    resolve_resume,
    resume_record,
    world_size,
)
from ulysses_mm.train.samples import wandb_media, write_samples
from ulysses_mm.train.saver import Saver
from ulysses_mm.train.step import build_setup, lay_out, train_step
from ulysses_mm.train.stop import (
    EXIT_STOPPED,
    STOPPED_FILE,
    Budget,
    StopRecord,
    StopRequests,
    agree,
    signal_name,
)

Stream = ShardStream | WindowStream


@dataclass
class TrainResult:
    steps: int
    run_dir: str
    checkpoint: str
    wandb_dir: str | None
    final_loss: float
    stopped: dict[str, Any] | None = None  # a StopRecord's fields when the run was stopped
    save_s: float = 0.0  # the slowest save's time to complete (blocking + background)
    blocked_s: float = 0.0  # the slowest save's blocking part
    step_s: float = 0.0  # the mean step time


class _Stop(Exception):
    """The ranks agreed to stop (raised inside an evaluation, caught by the loop)."""


class Trainer:
    """One rank of a training run: the plan, the setup (model → Ulysses → engine), the
    stream of this rank's samples, the logger; :meth:`run` steps to ``train.steps``.
    ``plan``: the parent's, when this rank runs in the parent's process (else it plans)."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: bool = False,
        stop: StopRequests | None = None,
        started: float | None = None,
        plan: RunPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.stop = stop or StopRequests([])
        self.started = started if started is not None else time.time()
        self.budget = Budget(cfg.train.max_minutes, self.started)
        self.stages = run_stages(cfg)
        # what each checkpoint's resume.json records: the stages as configured (the live
        # stages' model configs follow the model's RoPE as the run moves on)
        self.configured = run_stages(cfg)
        self.stage = self.stages[0]
        # the engine is built on the first stage's layout; later stages lay the model out
        # again on meshes of their own (the engine's gradient average stays the first's)
        self.place = open_world(self.stage.cfg)
        self.mesh = self.place.mesh
        self.device = self.place.device
        self.rank0 = self.mesh.rank == 0
        self.run_dir = Path(cfg.train.out_dir)
        self.ckpt = checkpoint.CheckpointDir.of(cfg)
        if self.rank0:
            if cfg.train.resume == "restart" and not resume:
                set_aside(cfg)
            (self.run_dir / STOPPED_FILE).unlink(missing_ok=True)
        plan = plan or plan_run(cfg, self.mesh.world_size, resume)
        self.manifest, self.eval_manifest, self.space = (
            plan.manifest,
            plan.eval_manifest,
            plan.space,
        )
        self.sources, self.windows = plan.stream_sources, plan.windows
        self.plan_sources = plan.sources
        d = cfg.data
        self.cache = NodeCache(d.cache_dir, d.cache_bytes) if d.cache_dir else None
        self.tokenizers = TokenizerTable.merged(
            TokenizerTable.from_manifest(m.tokenizers, m.config) for m, _ in plan.sources
        )
        self.units = units_for(self.space, self.tokenizers)
        stage_lr = self._stage_lr if len(self.stages) > 1 else None
        self.setup = build_setup(self.stage.cfg, self.space, self.place, stage_lr=stage_lr)
        self.engine, self.optimizer, self.model = (
            self.setup.engine,
            self.setup.optimizer,
            self.setup.model,
        )
        self.weights = self.setup.weights
        self.options = StreamOptions.from_config(d)
        self.saver = Saver(self.engine, self.ckpt, self.run_dir / "checkpoints-staging", cfg.train)
        self.step = 0
        self.saved_step: int | None = None  # the step the newest complete checkpoint holds
        client: dict[str, Any] = {}
        if resume:
            client = checkpoint.load(self.engine, self._local_checkpoints())
            self.step = self.saved_step = int(client["step"])
        self.stream = self._stream(self.sources, self.options)
        if resume:
            self._enter(stage_of(self.stages, self.step))
            self.stream.load_state_dict(client["loader"])
        self.logger = MetricsLogger(cfg, self.run_dir, self.rank0, resume_step=self.step)
        self.tflops = peak_tflops(cfg, self.device)
        self.trained_s = 0.0  # the steps this process trained, in seconds
        self.trained = 0

    def _local_checkpoints(self) -> Path:
        """The checkpoint directory DeepSpeed loads from: the run's own when local; for a
        remote one, the newest checkpoint downloaded once per node (local rank 0 fetches,
        the others wait at a barrier)."""
        if self.ckpt.is_local:
            return self.ckpt.local_path
        dest = self.run_dir / "checkpoints-restore"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            tag = self.ckpt.latest_tag()
            if tag is None:
                raise UserError(f"no checkpoint to resume from in {self.ckpt.url}")
            self.ckpt.download(tag, dest)
        if dist.is_initialized():
            dist.barrier()
        return dest

    # ------------------------------------------------------------------ stages
    def _stage_lr(self, step: int) -> float:
        """The re-warm-up factor of run step ``step`` (1-based), from its stage."""
        return stage_of(self.stages, step - 1).lr_factor(step)

    def _enter(self, stage: Stage) -> None:
        """Move the run to ``stage``: its mesh and attention layout, its RoPE, a stream of
        its windows continuing where the global order stands (the rest of a partly used
        sample skipped when the length changes); the engine and its optimizer state carry
        over."""
        if stage.index == self.stage.index:
            return
        old, new = self.stage.cfg, stage.cfg
        layout = Layout.from_config(new.parallel, self.mesh.world_size)
        if layout != self.mesh.layout:
            mesh = Mesh.over(layout)  # collective: every rank enters together
            self.place = replace(self.place, mesh=mesh)
            self.mesh = mesh
            self.setup.place = self.place
            lay_out(self.model, new, mesh, offload=self.setup.offload)
        if old.model.rope != new.model.rope:
            self.model.model.rotary_emb.set_rope(new.model.rope)
            self.model.config.rope = new.model.rope  # what samples and generation read
        state = self.stream.state_dict()
        self.stream.close()
        self.stage = stage
        self.stream = self._stream(self.sources, self.options)
        self.stream.load_state_dict(state)

    # ------------------------------------------------------------------ pieces
    def _stream(self, sources: Sources, options: StreamOptions, eval: bool = False) -> Stream:
        """This rank's stream of the stage's samples (windows of its length when the run
        cuts them)."""
        m, mb = self.mesh, self.stage.cfg.data.micro_batch_size
        stream: Stream
        if not self.windows:
            work = None if eval else self._work()
            stream = ShardStream(sources, m.dp_rank, m.dp, mb, options, self.cache, work)
        else:
            full = self.eval_manifest if eval and self.eval_manifest else self.manifest
            length = self.stage.cfg.data.seq_len or full.seq_len
            positions = self.stage.cfg.data.window_positions
            stream = WindowStream(
                sources, m.dp_rank, m.dp, mb, length, options, self.cache, positions
            )
        stream.set_interrupt(lambda: self.stop.requested)
        return stream

    def _work(self) -> Work | None:
        """How the training stream weighs samples (:mod:`~ulysses_mm.loader.balance`):
        balanced steps with dp > 1 and ``data.balance``, measured whenever every manifest
        records its samples' pairs; None when one does not."""
        balance = self.stage.cfg.data.balance and self.mesh.dp > 1
        lacking = [m.location for m, _ in self.plan_sources if m.sample_pairs is None]
        if lacking:
            if balance and self.rank0:
                warnings.warn(
                    f"{lacking[0]} records no sample_pairs (written by an older prepare): "
                    "steps are not balanced across DP ranks; prepare it again to balance them",
                    UserWarning,
                    stacklevel=2,
                )
            return None
        return Work(pairs_per_token(self.model.config), balance)

    def _fetch(self, stream: Stream, count: int) -> list[Batch] | None:
        """``count`` micro-batches of ``stream`` (None when a signal came while waiting for
        a shard: the run is about to stop, and the batches are not trained)."""
        try:
            if isinstance(stream, ShardStream):
                return [samples_batch(b, self.space) for b in stream.next_step(count)]
            return [samples_batch(stream.next_batch(), self.space) for _ in range(count)]
        except FetchInterrupted:
            return None

    def _agree(self) -> str | None:
        """The step-boundary agreement of every rank (one all-reduce): why the run stops
        (a signal's name, 'time budget'; None: it goes on). A checkpoint whose files every
        rank has finished is committed here."""
        pending = self.saver.pending is not None and not self.saver.local_done()
        signum, budget, busy = agree(
            [self.stop.signum or 0, int(self.budget.exhausted()), int(pending)], self.device
        )
        if self.saver.pending is not None and not busy:
            self._commit()
        if signum:
            return signal_name(signum)
        return "time budget" if budget else None

    def train_step(self, fulls: list[Batch]) -> dict[str, Any]:
        """One optimizer step on ``fulls``, the step's micro-batches."""
        t0 = time.perf_counter()
        sums = ModalitySums(self.space.modalities)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        result = train_step(self.setup, iter(fulls))
        for report in result.reports:
            sums.add(report)
        totals = [report.total for report in result.reports]
        tokens = sum(full.input_ids.numel() for full in fulls)
        pairs = sum(causal_pairs(full.doc_ids) for full in fulls)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.step += 1
        tokens *= self.mesh.dp  # every DP group processed as many
        pairs *= self.mesh.dp
        flops = train_flops(self.model, tokens, pairs, dict(sums.counts))
        metrics: dict[str, Any] = {
            "kind": "train",
            "stage": self.stage.index,
            "seq_len": int(fulls[0].input_ids.shape[1]),
            # the step's token-weighted loss, what its gradient is of (train_step)
            "loss": totals[0] if len(totals) == 1 else sums.weighted_mean(self.weights.tolist()),
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            **(
                {"mfu": flops / dt / (self.mesh.world_size * self.tflops * 1e12)}
                if self.tflops
                else {}
            ),
            "peak_memory_mb": peak_memory_mb(self.device),
            **sums.metrics(targets=True),
        }
        if isinstance(self.stream, ShardStream) and self.stream.last_work is not None:
            # the step's slowest-rank work over its mean: as read, and had it been read in order
            in_order, read = self.stream.last_work
            metrics["balance/max_over_mean"] = read.max_over_mean
            metrics["balance/in_order_max_over_mean"] = in_order.max_over_mean
        # each manifest's share of the samples, each weighted modality's of its manifest's tokens
        for label, share in self.stream.mix_shares().items():
            metrics[f"mix/{label}"] = share
        return metrics

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """The held-out figures of :func:`~ulysses_mm.train.evaluate.evaluate_batches`
        (what ``ulysses-mm evaluate`` computes) over ``train.eval_batches`` micro-batches."""
        assert self.eval_manifest is not None
        stream = self._stream(self.eval_manifest, self.options.in_order(), eval=True)
        count = min(self.cfg.train.eval_batches, stream.order.batches_per_epoch)
        self.engine.eval()

        def batches():  # the ranks agree before each batch: a signal stops the evaluation
            for _ in range(count):
                batch = self._fetch(stream, 1)
                reason = self._agree()
                if reason is not None:
                    raise _Stop(reason)
                assert batch is not None  # a rank interrupted while fetching voted to stop
                yield batch[0]

        try:
            result = evaluate_batches(self.setup, batches(), self.units)
        finally:
            stream.close()
            self.engine.train()
        return result

    def eval_media(self, result: EvalResult) -> dict[str, Any] | None:
        """W&B objects of an evaluation: its loss-by-position chart and, with
        ``logging.samples``, one generated document per modality (rank 0 generates; the
        other ranks wait for it at the next collective)."""
        samples = {}
        if self.cfg.logging.samples and self.rank0:
            self.engine.eval()
            try:
                samples = write_samples(
                    self.model,
                    self.tokenizers,
                    self.run_dir / "samples",
                    self.step,
                    self.cfg.logging.sample_tokens,
                    self.cfg.train.seed,
                )
            finally:
                self.engine.train()
        if self.logger.run is None:
            return None
        return wandb_media(samples, result.bins)

    def begin_save(self, loader: dict[str, Any] | None = None) -> None:
        """Start a checkpoint of this step (``loader``: the stream's state to record, by
        default where it stands); one in flight is finished first."""
        self.finish_save()
        stage = self.stage
        self.saver.start(
            self.step,
            client_state={
                "loader": loader if loader is not None else self.stream.state_dict(),
                "stage": stage.index,
                "stage_step": self.step - stage.start,
                "resume": resume_record(self.configured, self.step, self.manifest.seq_len),
            },
            # the model as this stage trains it (its RoPE, its layout)
            config=to_dict(stage.cfg),
            space=self.space,
            tokenizers=self.tokenizers.to_dict(),
        )

    def finish_save(self) -> None:
        """Wait for this rank's files of the checkpoint in flight, then for every rank's
        (an agreement), and commit it."""
        if self.saver.pending is None:
            return
        self.saver.wait()
        agree([0], self.device)  # every rank is past its wait: every file is written
        self._commit()

    def _commit(self) -> None:
        done = self.saver.commit()
        if done is None:
            return
        self.saved_step = done.step
        self.budget.save_took(self.saver.saves[-1][1])
        self.logger.checkpointed(done.step)  # W&B gets only steps a resume will not redo

    def checkpoint_path(self) -> str:
        tag = checkpoint.tag_for(self.saved_step) if self.saved_step is not None else ""
        return self.ckpt.url_of(tag) if tag else ""

    def run(self) -> TrainResult:
        t = self.cfg.train
        gas = self.cfg.deepspeed.gradient_accumulation_steps
        last: dict[str, Any] = {}
        progress = None
        if self.rank0:
            # one bar in one process: a thread lock, not tqdm's default multiprocessing
            # lock, whose semaphore a rank ended by the launcher would leave behind
            tqdm.set_lock(threading.RLock())
            progress = tqdm(
                total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True
            )
        reason: str | None = None
        loader: dict[str, Any] | None = None  # the stream's state at a stop
        try:
            while self.step < t.steps:
                self._enter(stage_of(self.stages, self.step))
                loader = self.stream.state_dict()
                batches = self._fetch(self.stream, gas)
                reason = self._agree()
                if reason is not None:
                    break
                assert batches is not None  # a rank interrupted while fetching voted to stop
                loader = None
                last = self.train_step(batches)
                self.budget.step_took(last["step_time_s"])
                self.trained_s += last["step_time_s"]
                self.trained += 1
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.logger.log(self.step, last)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(
                        loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}"
                    )
                if (
                    self.eval_manifest is not None
                    and t.eval_every
                    and self.step % t.eval_every == 0
                ):
                    try:
                        result = self.evaluate()
                    except _Stop as stop:
                        reason = str(stop)
                        break
                    metrics = {"kind": "eval", **result.metrics("eval/")}
                    self.logger.log(self.step, metrics, self.eval_media(result))
                if (
                    t.checkpoint_every and self.step % t.checkpoint_every == 0
                ) or self.step == t.steps:
                    self.begin_save()
            if reason is not None and self.saved_step != self.step and self.step > 0:
                self.begin_save(loader)  # the last completed step (a second signal ends at once)
            self.finish_save()
        except BaseException:
            # the error's line must stand alone: the bar is cleared, not left half drawn
            if progress is not None:
                progress.leave = False
                progress.close()
            self.stream.close()  # never waits on a fetch still in flight
            self.saver.close()
            raise
        if progress is not None:
            progress.leave = reason is None
            progress.close()
        self.stream.close()
        self.saver.close()
        stopped = None
        if reason is not None:
            record = StopRecord(self.step, t.steps, reason, self.checkpoint_path(), self.started)
            if self.rank0:
                record.write(self.run_dir)
            stopped = vars(record)
        wandb_dir = self.logger.finish()
        saves = self.saver.saves
        return TrainResult(
            self.step,
            str(self.run_dir),
            self.checkpoint_path(),
            wandb_dir,
            float(last.get("loss", math.nan)),
            stopped=stopped,
            save_s=max((w for _, w in saves), default=0.0),
            blocked_s=max((b for b, _ in saves), default=0.0),
            step_s=self.trained_s / self.trained if self.trained else 0.0,
        )


def set_aside(cfg: RunConfig) -> Path | None:
    """``train.resume=restart``: move the run in ``train.out_dir`` (checkpoints, metrics,
    W&B, samples) to ``RUN_DIR/previous/<UTC time>/``; nothing is deleted (the logs stay:
    they hold the record of a killed launch to clean up after)."""
    run_dir = Path(cfg.train.out_dir)
    names = ["checkpoints", "metrics.jsonl", "wandb", "wandb_id.txt", "samples", STOPPED_FILE]
    present = [n for n in names if (run_dir / n).exists()]
    if not present:
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(parents=True, exist_ok=True)
    for name in present:
        (run_dir / name).rename(dest / name)
    return dest


def train_worker(
    cfg_dict: dict[str, Any], resume: bool, started: float, plan: RunPlan | None = None
) -> dict[str, Any]:
    """One rank of ``ulysses-mm train``: the stop signals handled from the first moment,
    so a signal during the setup stops the run at its first step boundary. ``plan``: the
    parent's, when the rank runs in the parent's process."""
    cfg = from_dict(RunConfig, cfg_dict)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    announce = None
    if rank0 and not os.environ.get(launch.LAUNCHED_HERE):
        announce = "ulysses-mm train: ended at once by a second {signal}; latest is unchanged"
    stop = StopRequests(cfg.train.stop_signals, announce).install()
    try:
        trainer = Trainer(cfg, resume, stop, started, plan)
        result = trainer.run()
        if dist.is_initialized():
            dist.barrier()  # every rank's part of the stop is done before any leaves
    finally:
        stop.uninstall()
    if result.stopped is not None and (os.environ.get(launch.LAUNCHED_HERE) or in_launched_world()):
        # a launched rank leaves with the code itself: its launcher, signalled too, is
        # not reading return values, and torchrun reports the code
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        close_world()
        os._exit(EXIT_STOPPED)
    return vars(result)


def run_train(
    cfg: RunConfig,
    nproc: int | None,
    started: float | None = None,
    memory: MemoryCheck | None = None,
) -> dict[str, Any]:
    """Train in this process's launched world, or start ``nproc`` local processes.
    ``train.resume`` decides whether the run continues from its checkpoint; a run whose
    checkpoint is at ``train.steps`` already is not started again (``complete`` in the
    result). The run is planned once here (:func:`~ulysses_mm.train.plan.plan_run`, with
    ``memory``: the check of ``train.gpu_mem_gib``); a rank in this process trains on
    that plan, a rank of its own process plans again."""
    started = started if started is not None else time.time()
    if nproc and in_launched_world():
        raise UserError(
            "--nproc starts local processes; under torchrun or the DeepSpeed launcher leave it out"
        )
    resume = resolve_resume(cfg)
    # what the config decides fails here, not in a rank
    plan = plan_run(cfg, world_size(nproc), resume, memory)
    run_dir = Path(cfg.train.out_dir)
    if resume and plan.resumed.get("step") == cfg.train.steps:
        ckpt = checkpoint.CheckpointDir.of(cfg)
        return {
            "complete": True,
            "steps": cfg.train.steps,
            "run_dir": str(run_dir),
            "checkpoint": ckpt.url_of(checkpoint.tag_for(cfg.train.steps)),
        }
    t = cfg.train
    signals = launch.Signals(tuple(t.stop_signals), t.stop_grace_s)
    try:
        return launch.run_world(
            train_worker,
            nproc,
            to_dict(cfg),
            resume,
            started,
            plan if launch.in_process(nproc) else None,
            log_dir=run_dir / "logs",
            signals=signals,
        )[0]
    except (Interrupted, WorkerError) as e:  # a signal, or ranks leaving with code 75
        record = StopRecord.read(run_dir, started)
        if record is None and isinstance(e, Interrupted):
            latest = checkpoint.CheckpointDir.of(cfg).latest_tag()
            raise Interrupted(
                f"{e}, before the ranks could stop at a step; latest names "
                f"{latest or 'no checkpoint'}",
                e.signum,
            ) from None
        if record is None:
            raise
        return {
            "stopped": vars(record),
            "steps": record.step,
            "run_dir": str(run_dir),
            "checkpoint": record.checkpoint,
        }
