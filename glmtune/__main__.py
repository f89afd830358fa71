"""glmtune [+hw=CARD] [group=option ...] [key=value ...]   (or python -m glmtune ...; glmtune --help)

compose (Hydra) -> validate the config and every data line -> plan -> probe -> train. README.md: launches.
Every stop ends in one line and an exit code of launch/exits.py (`glmtune --help` lists them): bad input, a run
dir in use or holding another run and a full disk are 2.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before anything touches CUDA: expandable segments keep the allocator's reserve within ~3 % of what is
# allocated (measured on an H100: the default allocator reserved up to 21 % more, 5.4 GiB at evaluation).
# A value the user set is kept, and the plan then assumes the default allocator's larger reserve
# (glmtune/plan/reserve.py).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
from .launch.quiet import quiet_libraries  # noqa: E402 - after the allocator setting, before DeepSpeed is imported

quiet_libraries()

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config import CONF_DIR, ConfigError, check_override_keys
from .config.cli import check_command_line, chosen_mode, emits, is_multirun, wants_info
from .config.compose import run_once
from .launch import close_process_group, export_slurm_env, rank, run_name
from .launch.console import console, fail
from .launch.exits import EXIT_INTERRUPTED, EXIT_NO_TRIAL, STOP_PREFIX
from .launch.signals import STOP, Interrupted
from .launch.supervise import stop_descendants
from .modes import sweepstop
from .modes.prepare import prepare
from .modes.report import disk_full_line
from .modes.run import run_mode
from .modes.sweep import final_line, none_succeeded, run_trial
from .rundir.atomic import disk_nearly_full, is_disk_full
from .rundir.files import check_output_dirs, discard_unused, own_new_logs, unmake
from .rundir.lock import RunDirLock
from .rundir.resume import redirect

# Every rank of one launch must agree on the run dir; ${now:} alone would differ by a second. Cached in the
# config, so a SLURM sweep's jobs reuse the sweep dir the submitting process resolved.
OmegaConf.register_new_resolver("glmtune_run", run_name, replace=True, use_cache=True)


# Set by `cli` for mode=plan without hydra.run.dir: Hydra's run dir is then a temporary folder, removed after.
PLAN_SCRATCH: str | None = None


# An absolute path: Hydra reads it as a folder. A relative one becomes pkg://glmtune.conf under the console
# script, which Hydra only finds in a package with an __init__.py.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    export_slurm_env()  # a SLURM task of the submitit launcher: RANK, WORLD_SIZE, ... from SLURM's variables
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # a trial that fails or does not fit is recorded; the sweep goes on
        return run_trial(
            lambda: execute(cfg),
            Path(hydra_cfg.sweep.dir),
            Path(hydra_cfg.runtime.output_dir),
            hydra_cfg.job.num,
            list(hydra_cfg.overrides.task),
        )
    return execute(cfg)


def execute(cfg: DictConfig) -> float | None:
    """One run, holding its run dir's lock throughout; every way it can stop ends in one line and an exit code."""
    hydra_cfg = HydraConfig.get()
    fresh = Path(hydra_cfg.runtime.output_dir)
    # The same command as an interrupted run resumes it (rundir/resume.py); only a dir glmtune named is redirected.
    run_dir = redirect(fresh, OmegaConf.to_container(cfg, resolve=True), hydra_cfg.mode == RunMode.MULTIRUN)
    if run_dir != fresh:
        discard_unused(fresh)  # what Hydra made for the fresh dir: this rank's empty log, then the empty folder
        if rank() == 0:
            console.print(
                f"the same command ran before and did not finish: continuing {run_dir} "
                "(train.resume=restart starts a new run instead)",
                markup=False,
            )
    lock = RunDirLock(run_dir, rank())
    own_logs = own_new_logs(run_dir)  # removed with the dir if the input is bad: README says no run dir is left
    STOP.install()  # SIGTERM/SIGINT: one line now; a checkpoint first once training runs (launch/signals.py)
    try:
        lock.acquire()
        return _execute(cfg, run_dir, list(hydra_cfg.overrides.task))
    except ConfigError as err:
        lock.discard()
        discard_unused(run_dir, own_logs)  # a run that never started leaves no folder (an earlier run's files stay)
        fail(str(err))
    except Interrupted as sig:
        STOP.settle()  # stopping now: a repeat of the signal (launch/signals.py _watch, a second Ctrl-C) is ignored
        stop_descendants()  # what a library was starting when the signal came (datasets' manager, pool workers)
        STOP.requeue()  # submitit's pre-emption signal: resubmitted (rank 0 exits in it); nothing was saved
        mode = cfg.get("mode", "train")
        before = "training began" if mode in ("train", "probe") else f"mode={mode} was ready"
        # A stop that was asked for: "glmtune: stopped by ...", not an error line (exit 7 either way).
        fail(
            f"stopped by a second {sig.name} before the checkpoint was complete — re-run the same command to resume "
            "from the last complete one"
            if STOP.deferred
            else f"stopped by {sig.name} before {before}; nothing to save — re-run the same command to start again",
            code=EXIT_INTERRUPTED,
            leader_speaks=True,
            prefix=STOP_PREFIX,
        )
    except Exception as err:  # noqa: BLE001 - only a full disk is turned into one line; the rest re-raises
        if not (is_disk_full(err) or disk_nearly_full(run_dir)):
            raise
        fail(disk_full_line(err, run_dir))
    finally:
        lock.release()
        gc.unfreeze()  # modes/run.settle_process froze the heap for the run; the exit's own collection sees it again
        STOP.uninstall()
        STOP.received, STOP.deferred = None, False  # a sweep runs the next trial in this process


def _execute(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> float | None:
    prep = prepare(cfg, overrides)
    return run_mode(prep, run_dir, plan_scratch=PLAN_SCRATCH is not None)


def cli() -> None:
    """The `glmtune` command and `python -m glmtune`: --help/--version, command-line checks, then Hydra."""
    global PLAN_SCRATCH
    # A log line that cannot be written (full disk) must not print a traceback per line; the write that
    # matters fails too and is reported as one line (Python's docs advise this setting in production).
    logging.raiseExceptions = False
    argv = sys.argv[1:]
    info = wants_info(argv)
    if info is not None:
        print(info)
        return
    try:
        check_command_line(argv)
        check_override_keys(argv)
    except ConfigError as err:
        fail(str(err))
    made = check_output_dirs(argv)
    multirun = is_multirun(argv)
    PLAN_SCRATCH = None
    given_dir = any(a.startswith("hydra.run.dir=") for a in argv)
    if chosen_mode(argv) == "plan" and not (multirun or given_dir or emits(argv)):  # emitted files need a real dir
        PLAN_SCRATCH = tempfile.mkdtemp(prefix="glmtune-plan-")
        sys.argv.append(f"hydra.run.dir={PLAN_SCRATCH}")
    # Hydra then raises its composition errors instead of printing them with exit code 1; below they become
    # glmtune's one line with exit code 2 (the checks above catch the common ones with a better message).
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        # A plain run composes its config once (config/compose.py); the rest goes through hydra.main.
        if multirun or not run_once(main.__wrapped__, sys.argv[1:], str(CONF_DIR)):
            main()
    except (HydraException, OmegaConfBaseException) as err:
        unmake(made)
        fail(" ".join(str(err).split()))
    except Interrupted as sig:  # a second stop signal between two trials of a sweep (modes/sweepstop.py)
        sweepstop.mark_stopped()
        fail(
            f"stopped by a second {sig.name} between two trials; no trial was running — re-run the same sweep "
            "command to continue it: finished trials are kept",
            code=EXIT_INTERRUPTED,
            prefix=STOP_PREFIX,
        )
    except Exception:
        # The optuna sweeper asks its study for the best trial after the last one, which raises when none
        # completed; every trial is already recorded, and the sweep ends below with exit 9 instead.
        if not (multirun and none_succeeded()):
            raise
    finally:
        if PLAN_SCRATCH:
            shutil.rmtree(PLAN_SCRATCH, ignore_errors=True)
        if multirun:
            sweepstop.reset()  # the process's signal handlers as before the sweep, however it ended
    # Only after a run that ended normally: a rank that failed exits at once, and on NCCL a teardown could wait on
    # peers still inside a collective.
    close_process_group()
    if multirun and rank() == 0 and final_line():
        console.print(final_line(), markup=False)
    if multirun and none_succeeded():
        sys.exit(EXIT_NO_TRIAL)


if __name__ == "__main__":
    # `python -m glmtune` runs this file as `__main__`; the submitit launchers (SLURM, submitit_local) pickle the
    # task function, which cloudpickle copies by value from `__main__` (failing on its locks) but by reference
    # from an importable module. So the command runs the same code imported as glmtune.__main__.
    from glmtune.__main__ import cli as _cli

    _cli()
