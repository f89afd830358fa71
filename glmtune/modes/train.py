"""mode=train after the plan and the probe: train (resuming when the run dir says so), and end each way a
training can end (done, a stop signal, divergence, a crash) in its run_state.json status and its one line.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..launch import rank
from ..launch.console import console, fail
from ..launch.exits import EXIT_CRASH, EXIT_DIVERGED, EXIT_INTERRUPTED, STOP_PREFIX
from ..launch.signals import STOP, Interrupted
from ..plan.planner import Choices
from ..rundir.atomic import is_disk_full
from ..rundir.files import remove_empty_dirs
from ..rundir.lock import Start, trim_metrics, write_state
from ..rundir.resume import resume_command
from ..train.checkpoints import checkpoint_step, last_complete
from .prepare import Prepared, collator
from .report import crash_line, summary


def train_mode(
    prep: Prepared, plan, start: Start, choices: Choices, peaks: tuple[int, int | None], run_dir: Path, started: float
) -> float:
    """Train (resuming when `start` says so); a signal, divergence or finish each ends in its state and line.
    peaks: the predicted and the probe's measured peak (bytes), for the memory timeline and the trackers."""
    from ..probe.diagnose import diagnosed, record_memory_history
    from ..train.guard import Diverged, StoppedBySignal, describe_checkpoint, divergence_advice
    from ..train.saving import barrier
    from ..train.trainer import train
    from .sweepstop import trial_stop_advice

    run, data, leader = prep.run, prep.data, rank() == 0
    resume_step = checkpoint_step(start.resume_from) if start.resume_from else 0
    if leader:
        # `started` orders unfinished runs for resume.unfinished_run; a resume keeps the first launch's
        write_state(
            run_dir,
            status="running",
            mode="train",
            config=prep.config,
            choices=choices.to_dict(),
            step=resume_step,
            **({} if start.resume_from else {"started": round(time.time(), 3), "inputs": prep.inputs}),
        )
        if start.resume_from:
            trim_metrics(run_dir / "metrics.jsonl", resume_step)
    record_memory_history()
    try:
        with diagnosed(run_dir, plan.breakdown, choices.to_dict(), run.probe.enabled):
            metrics, _ = train(
                run,
                choices,
                run_dir,
                prep.model_dir,
                data.train,
                data.val,
                collator(prep),
                prep.tokenizer,
                peaks[0],
                plan.budget_bytes,
                resume_from=start.resume_from,
                probe_bytes=peaks[1],
                packer=prep.packing.packer(),
                user_ds=prep.user_ds,
            )
    except StoppedBySignal as stop:
        STOP.settle()  # the checkpoint is complete: nothing left for a later signal to protect
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="interrupted", step=stop.step, checkpoint=str(last))
        barrier()  # no rank exits (and makes torchrun stop the rest) before rank 0 is done
        line = f"stopped by {stop.name} at step {stop.step}: {describe_checkpoint(last)} — "
        if STOP.requeues():  # a submitit job at its time limit: submitit resubmits it, and it resumes here
            if leader:
                console.print(f"glmtune: {line}submitit requeues the job, which resumes from it", markup=False)
            STOP.requeue()  # rank 0 exits in it; the others end below, with exit 7
        advice = (
            trial_stop_advice()  # a sweep's trial: the sweep command continues it (modes/sweepstop.py)
            or f"re-run the same command to resume from it, or: {resume_command(run_dir, prep.overrides)}"
        )
        fail(
            f"{line}{advice}", code=EXIT_INTERRUPTED, leader_speaks=True, prefix=STOP_PREFIX
        )  # asked for, work kept: not an error
    except Diverged as bad:
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="diverged", step=bad.step, checkpoint=str(last or ""))
        advice = divergence_advice(run.train.learning_rate, choices.dtype, run.train.weight_decay)
        fail(
            f"training diverged at step {bad.step}: {bad.what}; {describe_checkpoint(last)} — {advice}, then start "
            "over with train.resume=restart or another hydra.run.dir",
            code=EXIT_DIVERGED,
        )
    except BaseException as crash:  # out of memory (exit 4), NCCL (5), any crash: the dir must not say running
        if leader:
            write_state(
                run_dir,
                status="interrupted" if isinstance(crash, Interrupted) else "failed",
                error=f"{type(crash).__name__}: {crash}"[:300],
            )
        if is_disk_full(crash):
            raise  # the entry point's one line for a full disk (exit 2), now that the state says failed
        if not isinstance(crash, Exception) or isinstance(crash, Interrupted):
            raise  # sys.exit of a diagnosed failure (its line is out), or a signal the entry point reports
        fail(
            f"training failed in {getattr(crash, 'glmtune_where', 'training')}: {crash_line(crash)} — the traceback "
            f"is in {log_traceback(crash) or 'rank0.log'}; run_state.json says failed. Re-running resumes from the "
            "last complete checkpoint, if any",
            code=EXIT_CRASH,
        )
    remove_empty_dirs(run_dir, "checkpoints")  # nothing was due: no save_steps/save_minutes point was reached
    if leader:
        write_state(run_dir, status="done", step=metrics["steps"], adapter=metrics["adapter_dir"])
        console.print(summary(metrics, time.monotonic() - started), markup=False)
    return metrics["train_loss"]


def log_traceback(crash: BaseException) -> str | None:
    """The crash's traceback into this rank's log file only (the console gets one line); returns that file."""
    import logging
    import traceback

    text = "".join(traceback.format_exception(crash))
    path = None
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(
                logging.makeLogRecord(
                    {
                        "msg": "training failed:\n%s",
                        "args": (text,),
                        "levelno": logging.ERROR,
                        "levelname": "ERROR",
                        "name": "glmtune",
                    }
                )
            )
            handler.flush()
            path = handler.baseFilename
    return path
