"""A stop signal stops a sweep whose trials run in this process, and the same sweep command continues it.

    glmtune +hparams_search=lora_optuna ...     # SIGTERM during trial 1: it saves, no trial 2, exit 7
    glmtune +hparams_search=lora_optuna ...     # the same command: trial 0 kept, trial 1 resumed, then 2, 3 ...

During a trial the run's own handler (launch/signals.STOP) answers a signal: the trial saves its checkpoint and
exits 7, which modes/sweep.run_trial records as `stopped` and turns into the end of the sweep. Between trials (the
sweeper's own code, a trial's set-up and bookkeeping) SWEEP_STOP records the signal, and the sweep ends before
the next trial starts; a second signal there ends it at once. Only with Hydra's basic launcher: a SLURM
launcher's trials are jobs of their own, and their launching process must stay stoppable as it is.

A stopped sweep leaves `stopped.json` in its sweep dir with its command line. Hydra names every sweep dir afresh
(multirun/DATE/TIME.mmm-<id>), so on its own the same command would start over; instead, when no
`hydra.sweep.dir=` is given, a sweep first looks under ./multirun for the newest stopped sweep of the same
command and continues in its dir (modes/sweep.py then skips its finished trials and resumes the stopped one).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from omegaconf import read_write

from ..launch import rank
from ..launch.console import console
from ..launch.exits import ERROR_PREFIX, EXIT_INTERRUPTED
from ..launch.signals import StopSignals
from ..rundir.atomic import write_json

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"  # Hydra's: every trial in this process
MARKER = "stopped.json"
GENERATED = re.compile(r"^\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d\.\d{3}-[0-9a-f]{4}$")  # launch.unique_run_name under multirun/
SWEEP_STOP = StopSignals()
_COMMAND: list[str] | None = None  # this sweep's command line (in-process trials only): what the marker records
_TRIAL: tuple[int, Path] | None = None  # the trial running in this process and its sweep dir
_DIR: Path | None = None  # this sweep's dir (in-process trials only)


def command_line(config) -> list[str]:
    """The sweep's overrides as Hydra parsed them, its sweep dir aside: what "the same sweep command" means."""
    hydra_overrides = [o for o in config.hydra.overrides.hydra if not o.startswith("hydra.sweep.dir=")]
    return [*config.hydra.overrides.task, *hydra_overrides]


def start(config) -> Path:
    """At the start of a multirun (the launching process): stop signals handled here when the trials run here,
    and the sweep dir, which may be a stopped sweep of the same command. Returns the sweep dir."""
    global _COMMAND, _DIR
    sweep_dir = Path(config.hydra.sweep.dir)
    if config.hydra.launcher.get("_target_") != BASIC_LAUNCHER:
        return sweep_dir
    SWEEP_STOP.install().deferred = True
    _COMMAND, _DIR = command_line(config), sweep_dir
    found = stopped_sweep(sweep_dir, _COMMAND) if not given_sweep_dir(config) else None
    if found is None:
        return sweep_dir
    _DIR = found
    with read_write(config):  # the launcher reads the dir here, and composes each trial's config from these overrides
        config.hydra.sweep.dir = str(found)
        config.hydra.overrides.hydra.append(f"hydra.sweep.dir={found}")
    console.print(
        f"the same sweep command was stopped before: continuing {found} (finished trials are kept)", markup=False
    )
    return found


def given_sweep_dir(config) -> bool:
    return any(o.startswith("hydra.sweep.dir=") for o in config.hydra.overrides.hydra)


def stopped_sweep(fresh: Path, command: list[str]) -> Path | None:
    """The newest sweep dir next to `fresh` (both named by glmtune) whose marker records the same command."""
    root = Path("multirun")
    try:
        if not GENERATED.match(fresh.relative_to(root).as_posix()):
            return None
    except ValueError:  # not under ./multirun: a dir of the user's config
        return None
    for marker in sorted(root.glob(f"*/*/{MARKER}"), reverse=True):  # names sort by start time
        try:
            if json.loads(marker.read_text()).get("command") == command:
                return marker.parent
        except (OSError, ValueError, AttributeError):
            continue
    return None


def end(config) -> None:
    """The sweep ran to its end: nothing is left to continue."""
    reset()
    (Path(config.hydra.sweep.dir) / MARKER).unlink(missing_ok=True)


def reset() -> None:
    """After a sweep however it ended (glmtune.__main__.cli): the process's handlers as they were."""
    global _COMMAND, _TRIAL, _DIR
    SWEEP_STOP.uninstall()
    SWEEP_STOP.received, SWEEP_STOP.deferred, _COMMAND, _TRIAL, _DIR = None, False, None, None, None


def enter_trial(num: int, sweep_dir: Path) -> None:
    """Before a trial: a signal since the last one ends the sweep here (exit 7), before anything starts."""
    global _TRIAL
    if SWEEP_STOP.received is not None:
        mark_stopped(sweep_dir)
        if rank() == 0:
            print(
                f"{ERROR_PREFIX}stopped by {SWEEP_STOP.received} between two trials; no further trial starts — "
                f"re-run the same sweep command to continue it ({sweep_dir}): finished trials are kept",
                file=sys.stderr,
            )
        raise SystemExit(EXIT_INTERRUPTED)
    _TRIAL = (num, sweep_dir) if _COMMAND is not None else None


def leave_trial() -> None:
    global _TRIAL
    _TRIAL = None


def stops_sweep() -> bool:
    """Whether a trial that a signal stopped ends the sweep (its trials run in this process)."""
    return _COMMAND is not None


def mark_stopped(sweep_dir: Path | None = None) -> None:
    """The sweep ends on a signal: its dir records the command that continues it."""
    sweep_dir = sweep_dir or _DIR
    if rank() == 0 and _COMMAND is not None and sweep_dir is not None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_json(sweep_dir / MARKER, {"command": _COMMAND})


def trial_stop_advice() -> str | None:
    """What a trial's stop line (modes/train.py) tells to do, when the run is a trial of a sweep in this process."""
    if _TRIAL is None:
        return None
    num, sweep_dir = _TRIAL
    return (
        f"the sweep stops here (no further trial starts); re-run the same sweep command to continue it "
        f"({sweep_dir}): trial {num} resumes from that checkpoint, finished trials are kept"
    )
