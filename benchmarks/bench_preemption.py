"""Many preemptions of one run, measured: a 2-process CPU run is stopped again and again
by a random signal (SIGTERM, SIGINT, SIGUSR1) sent at a random step to the launcher, to
every process (a terminal's Ctrl-C) or to one rank, with evaluations and background saves
in flight, and each time continued by the same command.

For each stop: the exit code (75 expected), the one line, the step it stopped after, and
the seconds from the signal to the launcher's exit. At the end the run's losses must be
the uninterrupted run's, bitwise, each step logged once. The last line is
``stops=K clean_stops=C median_stop_s=M max_stop_s=X steps_redone=R bitwise=B``.

    PYTHONPATH=. python benchmarks/bench_preemption.py [--stops 8] [--steps 80] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "helpers")]
_environ = dict(os.environ)
from train_data import cli_env, logged, prepare_dna, tiny_run, write_config  # noqa: E402

os.environ.clear()  # the test helpers' conftest import set test defaults: undone
os.environ.update(_environ)


def _command(config: Path) -> list[str]:
    return [sys.executable, "-m", "ulysses_mm", "train", str(config), "--nproc", "2"]


def _steps_logged(run: Path) -> list[int]:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return [r["step"] for r in rows if r["kind"] == "train"]


def _ranks(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = []
    for child in map(int, out.stdout.split()):
        try:
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def _stop_once(config: Path, run: Path, at_step: int, sig: signal.Signals, target: str) -> dict:
    """Run the same command, send ``sig`` to ``target`` once the run has logged
    ``at_step``; what happened."""
    proc = subprocess.Popen(
        _command(config),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        while proc.poll() is None and max(_steps_logged(run), default=0) < at_step:
            time.sleep(0.01)
        if proc.poll() is not None:
            proc.communicate()
            return {"finished_before": True, "code": proc.returncode}
        t0 = time.monotonic()
        if target == "launcher":
            os.kill(proc.pid, sig)
        elif target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(random.choice(_ranks(proc.pid)), sig)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [
        line
        for line in err.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("train:")
    ]
    stopped = json.loads((run / "stopped.json").read_text()) if proc.returncode == 75 else {}
    return {
        "signal": sig.name,
        "target": target,
        "sent_after": at_step,
        "code": proc.returncode,
        "stop_s": took,
        "lines": len(lines),
        "traceback": "Traceback" in err,
        "stopped_after": stopped.get("step"),
        "logged_max": max(_steps_logged(run), default=0),
        "line": lines[-1] if lines else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stops", type=int, default=8, help="preemptions of the run")
    ap.add_argument("--steps", type=int, default=80, help="the run's steps")
    ap.add_argument("--seed", type=int, default=0, help="seed of the signals, targets, steps")
    ap.add_argument("--smoke", action="store_true", help="2 stops of a 24-step run")
    args = ap.parse_args()
    if args.smoke:
        args.stops, args.steps = 2, 24
    rng = random.Random(args.seed)
    random.seed(args.seed)

    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as tmp:
        root = Path(tmp)
        train = prepare_dna(root, "train", records=60, seq_len=512, seed=0)
        held_out = prepare_dna(root, "eval", records=8, seq_len=512, seed=1)
        base = tiny_run(steps=args.steps, checkpoint_every=6, eval_every=5, eval_batches=4)
        data = {"train": str(train), "eval": str(held_out)}

        def config_of(name: str) -> Path:
            return write_config(root, name, base, data=data, train={"out_dir": str(root / name)})

        ref_cfg = config_of("ref")
        out = subprocess.run(_command(ref_cfg), cwd=REPO, env=cli_env(), capture_output=True)
        assert out.returncode == 0, out.stderr[-3000:]
        reference = logged(root / "ref")

        config = config_of("run")
        run = root / "run"
        spots = sorted(rng.sample(range(2, args.steps - 2), args.stops))
        stops = []
        for at in spots:
            sig = rng.choice([signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
            target = "group" if sig == signal.SIGINT else rng.choice(["launcher", "rank"])
            done = max(_steps_logged(run), default=0)
            stops.append(_stop_once(config, run, max(at, done + 1), sig, target))
            print(json.dumps(stops[-1]), flush=True)
        out = subprocess.run(_command(config), cwd=REPO, env=cli_env(), capture_output=True)
        assert out.returncode == 0, out.stderr[-3000:]
        steps_seen = _steps_logged(run)
        got = logged(run)

    clean = [
        s for s in stops if s.get("code") == 75 and s.get("lines") == 1 and not s.get("traceback")
    ]
    times = [s["stop_s"] for s in stops if "stop_s" in s]
    # steps trained but not in the stop's checkpoint are trained again by the next run
    redone = sum(s["logged_max"] - s["stopped_after"] for s in clean)
    bitwise = got == reference and sorted(steps_seen) == list(range(1, args.steps + 1))
    print(
        f"{len(stops)} stops of a {args.steps}-step 2-process run (checkpoint every 6, eval "
        f"every 5): {len(clean)} exited 75 with one line; signal to exit "
        f"median {statistics.median(times):.2f} s, max {max(times):.2f} s; final losses "
        f"{'bitwise equal to' if bitwise else 'DIFFERENT from'} the uninterrupted run's"
    )
    from _results import record

    figures = {
        "stops": len(stops),
        "clean_stops": len(clean),
        "median_stop_s": statistics.median(times),
        "max_stop_s": max(times),
        "steps_redone": redone,
        "bitwise": int(bitwise),
    }
    record("bench_preemption", figures, smoke=args.smoke, extra={"stops": stops})
    print(
        " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    )
    if not bitwise or len(clean) != len(stops):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
