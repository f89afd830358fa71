"""What a run leaves in its run dir besides the adapter (config, versions, plan), the output folders checked
before Hydra makes them, and what a launch that stopped on bad input takes back (empty logs and folders).

Written by rank 0 only, and only after the inputs validated, so a run that stops on bad input never
overwrites the files of an earlier run in the same folder; each file atomically (atomic.py), so a full
disk or a kill leaves the old file or the new one, never a 0-byte one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..launch import rank
from ..launch.console import fail
from .atomic import write_json, write_text


def check_output_dirs(argv: list[str]) -> list[Path]:
    """hydra.run.dir= / hydra.sweep.dir= naming a file (or a folder under a file), or a folder that cannot be
    made: one line and exit 2 before Hydra's mkdir raises FileExistsError/NotADirectoryError/... as a
    traceback. A value with ${...} is Hydra's to resolve and is left to it. Returns the folders it made."""
    made = []
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value or "${" in value:
            continue
        path = Path(value).expanduser()
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            fail(
                f"{key}={value}: {blocker} is a file, not a folder — give a folder (new or existing) for the "
                "run's files"
            )
        new = [p for p in (path, *path.parents) if not p.exists()]
        try:  # what Hydra does next; here its failure is one line (a read-only or virtual filesystem)
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            fail(f"{key}={value}: cannot create it ({err.strerror or err}) — give a folder you can write to")
        made += new
    return made


def unmake(made: list[Path]) -> None:
    """Remove the folders check_output_dirs made, deepest first, where still empty (a launch that stopped
    before its run began, e.g. on a Hydra composition error, leaves no folder behind)."""
    for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:
            pass


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_run_files(run_dir: Path, config_yaml: str, overrides: list[str], model: str, plan) -> str:
    """.hydra/config.yaml, .hydra/overrides.yaml, versions.json and plan.json; returns the config hash."""
    config_hash = hashlib.sha256(config_yaml.encode()).hexdigest()[:16]
    if rank() != 0:
        return config_hash
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_text(hydra_dir / "config.yaml", config_yaml)
    write_text(hydra_dir / "overrides.yaml", "".join(f"- {o}\n" for o in overrides) or "[]\n")
    versions = {name: _version(name) for name in ("torch", "transformers", "peft", "deepspeed", "glmtune")}
    versions.update(model_path=str(model), config_hash=config_hash)
    write_json(run_dir / "versions.json", versions)
    write_text(run_dir / "plan.json", plan.to_json() + "\n")
    return config_hash


def probed_peak(run_dir: Path) -> int | None:
    """The measured peak (bytes) an earlier launch's probe recorded in probe.json; None when there is none or it
    cannot be read (it only feeds the trackers on a resume, which must not fail over it)."""
    try:
        return json.loads((run_dir / "probe.json").read_text()).get("measured_peak_bytes")
    except (OSError, ValueError, AttributeError):
        return None


def remove_empty_dirs(run_dir: Path, *names: str) -> None:
    """Drop run-dir subfolders that a Trainer created and never wrote to (rank 0; README lists what stays)."""
    if rank() != 0:
        return
    for name in names:
        try:
            (run_dir / name).rmdir()  # only succeeds when empty
        except OSError:
            pass


def own_new_logs(run_dir: Path) -> list[Path]:
    """This process's log files in `run_dir` that are still empty or not yet created (the rank log's handler
    opens its file at the first record: conf/config.yaml `delay: true`), i.e. made by this launch: Hydra appends
    to an earlier run's log, which is never in this list."""
    found = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir.resolve():
            path = Path(handler.baseFilename)
            try:
                if path.stat().st_size == 0:
                    found.append(path)
            except FileNotFoundError:
                found.append(path)
            except OSError:
                pass
    return found


def discard_unused(run_dir: Path, own_logs: list[Path] = ()) -> None:
    """After bad input, undo what Hydra made for this run: empty rank logs and the logs this launch made
    (`own_logs`, from own_new_logs: what they say is on the console already), then the folders left empty.

    Only those files and empty folders go, so an earlier run's dir given again with hydra.run.dir keeps its files.
    Parents are removed only inside ./outputs (Hydra's default DATE/TIME folders), never a folder of the user's."""
    if not run_dir.is_dir():
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) in own_logs:
            root.removeHandler(handler)  # closed and detached: a later record would reopen (recreate) the file
            handler.close()
    for log in [*run_dir.glob("rank*.log"), *own_logs]:
        if log in own_logs or (log.is_file() and log.stat().st_size == 0):
            log.unlink(missing_ok=True)
    outputs = (Path.cwd() / "outputs").resolve()
    folder = run_dir.resolve()
    while True:
        try:
            folder.rmdir()
        except OSError:  # not empty (or already gone, from another rank)
            if folder.exists():
                return
        folder = folder.parent
        if folder != outputs and outputs not in folder.parents:
            return
