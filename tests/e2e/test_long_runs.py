"""Long runs survive the cluster, with real processes: a signal to the launcher, to every
process (Ctrl-C) or to one rank stops a 2-process run at a step boundary with a complete
checkpoint, exit 75 and one line; the same command then continues it to the losses of an
uninterrupted run, bitwise; a time budget stops a run with a checkpoint; a second signal
ends a process at once; checkpoints on S3 (moto on 127.0.0.1) round-trip, and a server
that goes away mid-upload is one line with the previous checkpoint still usable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from byte_proxy import ByteCountingProxy
from conftest import REPO
from train_data import cli_env, logged, prepare_dna, tiny_run, write_config

STEPS, SEQ = 120, 512
BASE = tiny_run(steps=STEPS, checkpoint_every=50)
_env = cli_env


def _config(root: Path, name: str, **sections) -> Path:
    sections["train"] = {"out_dir": str(root / name), **sections.get("train", {})}
    return write_config(root, name, BASE, **sections)


def _command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ulysses_mm", "train", str(config), "--nproc", "2", *extra]


def _train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(config, *extra), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
    )


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return logged(run)


def _lines(stderr: str) -> list[str]:
    """What the user reads: stderr without the progress bar's redraws."""
    out = []
    for line in stderr.replace("\r", "\n").splitlines():
        if line.strip() and not line.startswith("train:"):
            out.append(line)
    return out


def _interrupt(config: Path, send, *extra: str, after_steps: int = 8, timeout: float = 60):
    """Start the run in its own process group, wait until ``after_steps`` steps are logged,
    call ``send(proc)``; returns (exit code, stderr, seconds from the signal to the exit)."""
    run = Path(yaml.safe_load(config.read_text())["train"]["out_dir"])
    proc = subprocess.Popen(
        _command(config, *extra),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be signalled"
        t0 = time.monotonic()
        send(proc)
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _workers(proc: subprocess.Popen) -> list[int]:
    """The launcher's rank processes (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    ranks = []
    for pid in map(int, out.stdout.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            ranks.append(pid)
    return ranks


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-runs")
    return {
        "root": root,
        "train": prepare_dna(root, "train", records=60, seq_len=SEQ, seed=0),
        "eval": prepare_dna(root, "eval", records=8, seq_len=SEQ, seed=1),
    }


@pytest.fixture(scope="module")
def reference(data):
    """The uninterrupted run."""
    cfg = _config(data["root"], "ref", data={"train": str(data["train"])})
    out = _train(cfg)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(data["root"] / "ref")


def _stopped_then_continued(fx, reference, name: str, send, *, extra=(), **sections):
    """Stop the run with ``send``; check the exit, the line and the checkpoint; rerun the
    same command; check it ends on the uninterrupted losses. Returns the stop's line."""
    sections.setdefault("data", {"train": str(fx["train"])})
    cfg = _config(fx["root"], name, **sections)
    run = fx["root"] / name
    code, err, took = _interrupt(cfg, send, *extra)
    lines = _lines(err)
    assert code == 75, err[-3000:]
    assert took < 30, f"took {took:.1f} s to stop"
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    step = stopped["step"]
    assert lines[0].startswith(f"ulysses-mm train: stopped on {stopped['reason']} after step ")
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert f"checkpoint {run / 'checkpoints' / f'step_{step:08d}'}" in lines[0]
    assert "continue with: ulysses-mm train " in lines[0]
    assert 0 < step < STEPS
    assert not list(run.rglob("*.tmp")) and not list(run.rglob(".*tmp*"))
    done = _train(cfg, *extra)  # the same command: train.resume=auto continues it
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run / "stopped.json").exists()
    got = _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))  # no step lost, none repeated
    assert got == reference  # bitwise: the same floats as the uninterrupted run
    return lines[0]


def test_sigterm_to_the_launcher(data, reference):
    line = _stopped_then_continued(
        data, reference, "term", lambda p: os.kill(p.pid, signal.SIGTERM)
    )
    assert "stopped on SIGTERM" in line


def test_ctrl_c_is_one_line(data, reference):
    line = _stopped_then_continued(
        data, reference, "ctrl-c", lambda p: os.killpg(p.pid, signal.SIGINT)
    )
    assert "stopped on SIGINT" in line


def test_sigusr1_to_one_rank_while_it_evaluates(data, reference):
    def one_rank(proc):
        os.kill(_workers(proc)[-1], signal.SIGUSR1)

    line = _stopped_then_continued(
        data,
        reference,
        "usr1-eval",
        one_rank,
        data={"train": str(data["train"]), "eval": str(data["eval"])},
        train={"eval_every": 1, "eval_batches": 4},
    )
    assert "stopped on SIGUSR1" in line


def test_a_time_budget_stops_with_a_checkpoint(data):
    cfg = _config(data["root"], "budget", data={"train": str(data["train"])})
    run = data["root"] / "budget"
    t0 = time.monotonic()
    out = _train(cfg, "train.steps=100000", "--max-minutes", "0.25")
    took = time.monotonic() - t0
    assert out.returncode == 75, out.stderr[-3000:]
    lines = _lines(out.stderr)
    assert len(lines) == 1 and "stopped on time budget after step" in lines[0], lines
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["step"] > 0
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped['step']:08d}"
    assert took < 15 + 20, f"a 15 s budget took {took:.1f} s"  # + the interpreter's start


def test_rerun_of_a_finished_run_trains_nothing_and_never_is_refused(data, reference):
    run = data["root"] / "ref"
    cfg = data["root"] / "ref.yaml"
    before = (run / "metrics.jsonl").read_text()
    out = _train(cfg)
    assert out.returncode == 0 and "is complete: step 120 of 120" in out.stdout, out.stderr
    out = _train(cfg, "train.resume=never")
    assert out.returncode == 2 and "holds a run" in out.stderr and out.stderr.count("\n") == 1
    out = _train(cfg, "train.steps=60")
    assert out.returncode == 2 and "is at step 120" in out.stderr
    assert (run / "metrics.jsonl").read_text() == before  # nothing truncated
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000120"


def test_a_second_signal_ends_a_process_at_once(tmp_path):
    """The handler itself: a copy of the first signal within 2 s is the same request; one
    after that exits 128 + its number."""
    script = (
        "import os, signal, sys, time\n"
        "from ulysses_mm.train.stop import StopRequests\n"
        "s = StopRequests(['SIGTERM', 'SIGUSR1'], 'second {signal}').install()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
        "print(s.name, flush=True)\n"
        "time.sleep(2.1)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(5)\n"
        "print('still here', flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 128 + signal.SIGUSR1, out
    assert out.stdout.split() == ["SIGTERM"] and out.stderr.strip() == "second SIGUSR1"


def _s3(endpoint: str) -> tuple[dict, str]:
    import fsspec

    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"  # moto keeps buckets for the whole process
    fsspec.filesystem("s3", **opts).mkdir(bucket)
    return opts, bucket


def test_checkpoints_on_s3_round_trip(data, reference, s3_server):
    opts, bucket = _s3(s3_server)
    _stopped_check_s3 = _stopped_then_continued_s3(data, reference, opts, bucket)
    assert _stopped_check_s3.startswith("ulysses-mm train: stopped on SIGTERM")


def _stopped_then_continued_s3(data, reference, opts: dict, bucket: str) -> str:
    import fsspec

    url = f"s3://{bucket}/run/checkpoints"
    cfg = _config(
        data["root"],
        "s3",
        data={"train": str(data["train"]), "storage_options": opts},
        train={"checkpoint_dir": url},
    )
    run = data["root"] / "s3"
    code, err, _ = _interrupt(cfg, lambda p: os.kill(p.pid, signal.SIGTERM))
    assert code == 75, err[-3000:]
    fs = fsspec.filesystem("s3", **opts)
    tag = fs.cat(f"{url}/latest").decode().strip()
    step = json.loads((run / "stopped.json").read_text())["step"]
    assert tag == f"step_{step:08d}"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/{tag}", detail=False)}
    assert {"mp_rank_00_model_states.pt", "model.safetensors", "resume.json"} <= names
    assert not (run / "checkpoints").exists()  # nothing written to the local run dir's
    done = _train(cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(run) == reference
    return _lines(err)[0]


def test_an_s3_server_gone_mid_upload_is_one_line(data, s3_server):
    import fsspec

    port = int(s3_server.rsplit(":", 1)[1])
    opts, bucket = _s3(s3_server)
    url = f"s3://{bucket}/gone/checkpoints"
    proxy = ByteCountingProxy(("127.0.0.1", port)).start()
    proxied = {**opts, "endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 2}}}
    cfg = _config(
        data["root"],
        "gone",
        data={"train": str(data["train"]), "storage_options": proxied},
        train={"checkpoint_dir": url, "checkpoint_every": 4},
    )
    fs = fsspec.filesystem("s3", **opts)
    proc = subprocess.Popen(
        _command(cfg),
        cwd=REPO,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if fs.exists(f"{url}/latest"):
                break
            time.sleep(0.05)
        proxy.stop()  # the server goes away while the next checkpoints upload
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    lines = _lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "checkpoint" in lines[0] and url in lines[0], lines[0]
    fs.invalidate_cache()
    tag = fs.cat(f"{url}/latest").decode().strip()
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/{tag}", detail=False)}
    assert {"mp_rank_00_model_states.pt", "model.safetensors", "resume.json"} <= names
    # the previous checkpoint is still usable: the run continues from it, on the server
    direct = _config(
        data["root"],
        "gone-resumed",
        data={"train": str(data["train"]), "storage_options": opts},
        train={"checkpoint_dir": url, "checkpoint_every": 4, "out_dir": str(data["root"] / "gone")},
    )
    out = _train(direct, "train.steps=16")
    assert out.returncode == 0, out.stderr[-3000:]
    assert fs.cat(f"{url}/latest").decode().strip() == "step_00000016"


def test_kill_9_of_the_launcher_ends_its_ranks_and_the_rerun_cleans_up(data, reference):
    """The ranks die with their launcher (no orphan trains on); what the killed launch left
    in /dev/shm and its agent folder go with the next run, which ends on the uninterrupted
    losses."""
    cfg = _config(data["root"], "kill-9", data={"train": str(data["train"])})
    run = data["root"] / "kill-9"
    ranks: list[int] = []

    def kill_launcher(proc):
        ranks.extend(_workers(proc))
        os.kill(proc.pid, signal.SIGKILL)

    code, _, _ = _interrupt(cfg, kill_launcher)
    assert code == -signal.SIGKILL and len(ranks) == 2
    deadline = time.monotonic() + 1.0
    alive = ranks
    while alive and time.monotonic() < deadline:
        alive = [p for p in ranks if Path(f"/proc/{p}").exists() and _running(p)]
        time.sleep(0.02)
    assert not alive, f"ranks {alive} outlived their launcher by a second"
    assert (run / "logs" / "launch.json").exists()  # the killed launch's record
    done = _train(cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run / "logs" / "launch.json").exists() and not (run / "logs" / "agent").exists()
    got = _losses(run)
    assert got == reference


def _running(pid: int) -> bool:
    """Not a zombie (a dead child its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
