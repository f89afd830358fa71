"""Hydra multirun bookkeeping: every trial is recorded, a failed one does not stop the sweep.

    python -m glmtune -m lora.r=4,8,16 train.learning_rate=1e-4,5e-4       # grid, one trial after another
    python -m glmtune +hparams_search=lora_optuna                          # optuna (the [sweep] extra)
    python -m glmtune -m hydra/launcher=slurm +hw=a100_80g lora.r=8,16     # each trial a SLURM job

Hydra's basic sweeper re-raises the first failed trial and ends the sweep, and the optuna sweeper does
the same unless `max_failure_rate` allows it. A trial that does not fit the card (exit 3), has a bad
override (exit 2) or crashes is a result worth keeping ("r=64 does not fit on a 24 GB card"), so
`run_trial` catches it, records it, and returns None: the optuna sweeper (1.3.0) then files the trial as
failed (`float(None)` fails before it tells the study anything) and the study goes on. NaN would not do: optuna
refuses a NaN value, and the sweeper's second `tell(FAIL, values=[nan])` raises and ends the sweep. A sweep in
which no trial succeeded exits EXIT_NO_TRIAL (9), so a script or a CI job can tell.

A re-run into the same `hydra.sweep.dir` skips every trial already recorded as ok with the same overrides (it
returns the recorded metric, so a seeded optuna sampler proposes the same next trials); an unfinished trial
runs again in its own run dir (`<sweep dir>/<num>/`), which resumes it from its last complete checkpoint.

A stop signal (SIGTERM, Ctrl-C's SIGINT, SIGUSR1) stops the sweep, not only its trial (modes/sweepstop.py): the
trial saves its checkpoint and is recorded `stopped`, no further trial starts, the sweep exits 7 with one line,
and the same sweep command continues it. A trial of the SLURM launcher (a job of its own) is recorded `stopped`
and its sweep goes on: the other jobs run anyway.

Each trial appends one JSON line to `<sweep dir>/trials.jsonl` (its overrides, status, the plan's fit and
peak, the probe's measured peak, losses, run dir), then rewrites `<sweep dir>/summary.md` from all lines,
so the table is current while the sweep runs and survives a sweep that is killed. Only rank 0 of a trial
writes. The numbers come from the files the trial left in its run dir (plan.json, probe.json,
metrics.json): the table shows exactly what each run dir holds.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from hydra.experimental.callback import Callback

from ..config.units import GIB
from ..launch import rank
from ..launch.console import console
from ..launch.exits import ERROR_PREFIX, EXIT_INTERRUPTED, EXIT_NO_FIT
from ..launch.signals import Requeued
from ..rundir.atomic import append_line, read_jsonl, write_text
from . import sweepstop

# The text of glmtune's one line, anywhere in a line: a progress bar's last update (ended by \r) may precede it.
ONE_LINE = re.compile(re.escape(ERROR_PREFIX) + r"(.*)|glmtune: (stopped by .*)")

_SWEEP_DIR: Path | None = None  # where this process recorded trials, for the sweep's last line (final_line)


class _Tee(io.TextIOBase):
    """stderr that is also kept, so a trial's one-line `glmtune: error: ...` reaches the summary."""

    def __init__(self, stream: TextIO):
        self.stream, self.lines = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.lines.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def error_line(self) -> str | None:
        # glmtune's one line: an error, or a stop that kept its work ("glmtune: stopped by SIGTERM at step ...")
        found = [m.group(1) or m.group(2) for m in map(ONE_LINE.search, self.lines.getvalue().splitlines()) if m]
        return found[-1] if found else None


def run_trial(
    task: Callable[[], float | None], sweep_dir: Path, run_dir: Path, num: int, overrides: list[str]
) -> float | None:
    """Run one trial, record it, and return its metric (eval loss, else train loss; None if it failed)."""
    global _SWEEP_DIR
    sweepstop.enter_trial(num, sweep_dir)  # a stop signal since the last trial ends the sweep here
    done = next(
        (t for t in read_trials(sweep_dir) if t["num"] == num and t["overrides"] == overrides and t["status"] == "ok"),
        None,
    )
    if done is not None:  # a re-run of this sweep: the trial finished before; never train it twice
        _SWEEP_DIR = sweep_dir
        if rank() == 0:
            console.print(f"trial {num}: ok before (run dir {done['run_dir']}), not run again", markup=False)
        return None if math.isnan(done["metric"]) else done["metric"]
    start, tee = time.monotonic(), _Tee(sys.stderr)
    status, error, code = "ok", None, 0
    sys.stderr = tee
    try:
        task()
    except Requeued as again:  # submitit resubmitted the job at its time limit: the trial goes on there
        raise SystemExit(again.code) from None
    except SystemExit as exc:  # glmtune's own stops: 2 bad input, 3 does not fit, 4 out of memory, 7 a signal...
        code = exc.code if isinstance(exc.code, int) else 1
        status = {0: "ok", EXIT_NO_FIT: "does not fit", EXIT_INTERRUPTED: "stopped"}.get(code, "failed")
        error = tee.error_line() or f"exit code {code}"
    except Exception as exc:  # noqa: BLE001 - any crash is one failed trial, not the end of the sweep
        import logging
        import traceback

        logging.getLogger(__name__).error("trial %d failed:\n%s", num, traceback.format_exc())
        status, error, code = "failed", f"{type(exc).__name__}: {exc}", 1
    finally:
        sys.stderr = tee.stream
        sweepstop.leave_trial()
    record = trial_record(run_dir, num, overrides, status, error, code, time.monotonic() - start)
    if rank() == 0:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        append_line(sweep_dir / "trials.jsonl", json.dumps(record))
        summary = write_summary(sweep_dir)
        _SWEEP_DIR = sweep_dir
        loss = "" if math.isnan(record["metric"]) else f", loss {record['metric']:.4f}"
        console.print(
            f"trial {num}: {status}{loss} (table: {summary}; one line per trial: {sweep_dir / 'trials.jsonl'})",
            markup=False,
        )
    if status == "stopped" and sweepstop.stops_sweep():
        # No further trial: Hydra's launcher and the sweepers catch Exception only, so this ends the sweep (exit 7;
        # the trial's line said what to do).
        sweepstop.mark_stopped(sweep_dir)
        raise SystemExit(EXIT_INTERRUPTED)
    return None if math.isnan(record["metric"]) else record["metric"]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def trial_record(
    run_dir: Path, num: int, overrides: list[str], status: str, error: str | None, code: int, seconds: float
) -> dict:
    plan, probe, metrics = (_read(run_dir / name) for name in ("plan.json", "probe.json", "metrics.json"))
    loss = metrics.get("eval_loss", metrics.get("train_loss"))
    return {
        "num": num,
        "overrides": overrides,
        "status": status,
        "exit_code": code,
        "error": error,
        "fits": plan.get("fits"),
        "planned_peak_bytes": plan.get("peak_bytes"),
        "measured_peak_bytes": probe.get("measured_peak_bytes"),
        "train_loss": metrics.get("train_loss"),
        "last_logged_loss": metrics.get("last_logged_loss"),
        "eval_loss": metrics.get("eval_loss"),
        "metric": float(loss) if status == "ok" and loss is not None else math.nan,
        "seconds": round(seconds, 1),
        "run_dir": str(run_dir),
        "adapter": str(run_dir / "adapter") if (run_dir / "adapter").is_dir() else None,
    }


def read_trials(sweep_dir: Path) -> list[dict]:
    """One record per trial number, the last written (a re-run appends a resumed trial again); a torn last
    line is skipped."""
    latest = {r["num"]: r for r in read_jsonl(sweep_dir / "trials.jsonl")}
    return [latest[num] for num in sorted(latest)]


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def _num(value: float | None) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def _first(*values: float | None) -> float | None:
    """The last logged loss, or the run's mean train loss when fewer steps ran than logging_steps."""
    return next((v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))), None)


def format_summary(trials: list[dict]) -> str:
    """A Markdown table, one row per trial, best metric first among the trials that finished."""
    lines = [
        "| # | overrides | status | fits | planned peak GiB | measured peak GiB | final loss | eval loss | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        fits = "" if t["fits"] is None else "yes" if t["fits"] else "no"
        note = (t["error"] or "").replace("|", "\\|")[:200]
        lines.append(
            f"| {t['num']} | `{' '.join(t['overrides'])}` | {t['status']} | {fits} | "
            f"{_gib(t['planned_peak_bytes'])} | {_gib(t['measured_peak_bytes'])} | "
            f"{_num(_first(t['last_logged_loss'], t['train_loss']))} | {_num(t['eval_loss'])} | {note} |"
        )
    failed = sum(t["status"] not in ("ok", "stopped") for t in trials)
    stopped = sum(t["status"] == "stopped" for t in trials)
    return "\n".join(
        [
            f"# sweep summary: {len(trials)} trials, {failed} failed or not fitting"
            + (f", {stopped} stopped (the same sweep command resumes them)" if stopped else ""),
            "",
            *lines,
            "",
            best_trial(trials),
            "",
        ]
    )


def best_trial(trials: list[dict]) -> str:
    done = [t for t in trials if not math.isnan(t["metric"])]
    best = min(done, key=lambda t: t["metric"], default=None)
    return (
        f"best: trial {best['num']} (`{' '.join(best['overrides'])}`), loss {best['metric']:.4f}, "
        f"run dir {best['run_dir']}" + (f", adapter {best['adapter']}" if best.get("adapter") else "")
        if best
        else "no trial has a loss (none trained, or all failed)"
    )


class RecordedFailures(logging.Filter):
    """The optuna sweeper logs `Failed experiment: Return value must be float-castable. Got 'None'.` for every trial
    run_trial returned None for: Hydra's words for a trial glmtune has already reported in its own line and
    recorded. Dropped; any other failure the sweeper logs still shows."""

    SWEEPER = "hydra_plugins.hydra_optuna_sweeper._impl"

    def filter(self, record: logging.LogRecord) -> bool:
        return "float-castable. Got 'None'" not in record.getMessage()


class SweepDir(Callback):
    """A Hydra callback (conf/config.yaml hydra.callbacks): the sweep dir, known in the process that launches
    the sweep. With the basic launcher the trials run in that process and run_trial records it anyway; with the
    submitit launchers (SLURM, submitit_local) they run in jobs, and the launching process, which prints the
    sweep's last line and exit code, reads their trials.jsonl from the (shared) sweep dir."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _SWEEP_DIR
        sweeper_log = logging.getLogger(RecordedFailures.SWEEPER)
        if not any(isinstance(f, RecordedFailures) for f in sweeper_log.filters):
            sweeper_log.addFilter(RecordedFailures())
        _SWEEP_DIR = sweepstop.start(config)  # a stopped sweep of the same command continues in its dir

    def on_multirun_end(self, config, **kwargs) -> None:
        sweepstop.end(config)


def final_line() -> str | None:
    """The sweep's last console line: where its table is, and the best trial (None if no trial ran here)."""
    if _SWEEP_DIR is None:
        return None
    trials = read_trials(_SWEEP_DIR)
    failed = sum(t["status"] != "ok" for t in trials)
    return (
        f"sweep done: {len(trials)} trials, {failed} failed or not fitting; summary {_SWEEP_DIR / 'summary.md'}, "
        f"trials {_SWEEP_DIR / 'trials.jsonl'}; {best_trial(trials)}"
    )


def none_succeeded() -> bool:
    """Whether this process ran a sweep and not one of its trials ended ok (the sweep's exit code is then 9)."""
    return _SWEEP_DIR is not None and not any(t["status"] == "ok" for t in read_trials(_SWEEP_DIR))


def write_summary(sweep_dir: Path) -> Path:
    path = sweep_dir / "summary.md"
    write_text(path, format_summary(read_trials(sweep_dir)))
    return path
