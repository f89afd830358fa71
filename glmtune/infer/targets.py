"""Where an export may write (`infer.merge_to`, whatever format is written there): decided before any weights load.

An export never replaces an input. A target that is, contains or lies inside `model.path`, `infer.adapter` or the
run dir, or that is or contains `infer.prompts_file`, is refused whatever `infer.overwrite` says (with it, a
merge into the folder holding `model.path` used to delete the base weights). `infer.overwrite=true` replaces
only a folder an earlier glmtune export wrote, which its MARKER file says; any other folder with files in it is
the user's and is never deleted. A target that cannot be written (a file, a device, a read-only or pseudo
filesystem, a parent folder that does not exist) is one line now, found by creating and removing a probe folder
beside it, instead of a traceback after minutes of merging. A merge killed mid-write leaves its hidden
`.NAME.*.tmp` folder beside the target (rundir/atomic.folder_as_one_unit); the next export into the same target
removes those whose writer is gone. A full disk while writing is one line that names the target.

Every exporter calls `check_export_target` first and `mark_export` in the folder it builds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ..config import ConfigError, InferConfig
from ..rundir.atomic import is_disk_full

MARKER = ".glmtune-export.json"  # in every folder a glmtune export wrote: what infer.overwrite may replace
STALE_S = 60  # a marker-less temporary folder older than this is an export killed before it wrote its marker


def export_inputs(cfg: InferConfig, model_dir: Path, run_dir: Path) -> tuple[dict[Path, str], dict[Path, str]]:
    """(the folders an export may not touch, the files it may not touch), resolved, each with its key."""
    folders = {Path(model_dir).expanduser().resolve(): "model.path", Path(run_dir).resolve(): "run dir"}
    if cfg.adapter:
        folders[Path(cfg.adapter).expanduser().resolve()] = "infer.adapter"
    files = {Path(cfg.prompts_file).expanduser().resolve(): "infer.prompts_file"} if cfg.prompts_file else {}
    return folders, files


def check_export_target(
    key: str, value: str, folders: dict[Path, str], files: dict[Path, str], overwrite: bool
) -> Path:
    """The target folder `value` (of config key `key`), or ConfigError with the one line saying why not."""
    target = Path(value).expanduser()
    shown = f"{key}={value}"
    resolved = target.resolve()  # a link to model.path is model.path
    for path, name in folders.items():
        how = (
            "is"
            if resolved == path
            else "contains"
            if path.is_relative_to(resolved)
            else "lies inside"
            if resolved.is_relative_to(path)
            else None
        )
        if how:
            raise ConfigError(
                f"{shown} {how} the {name} folder ({path}): an export never writes over or into an "
                "input, whatever infer.overwrite says — choose a new folder outside it"
            )
    for path, name in files.items():
        if path == resolved or path.is_relative_to(resolved):
            raise ConfigError(
                f"{shown} {'is' if path == resolved else 'contains'} {name} ({path}): an export never "
                "replaces an input, whatever infer.overwrite says — choose a new folder"
            )
    if target.exists() or target.is_symlink():
        _check_existing(target, shown, overwrite)
    parent = resolved.parent
    if not parent.is_dir():
        raise ConfigError(
            f"{shown}: its parent folder {parent} does not exist — create it first, or choose another folder"
        )
    try:  # what the export does there: a hidden folder beside the target, renamed into place at the end
        os.rmdir(tempfile.mkdtemp(prefix=f".{resolved.name}.", suffix=".probe", dir=parent))
    except OSError as err:
        raise ConfigError(
            f"{shown}: cannot write in {parent} ({err.strerror or err}) — choose a folder on a writable disk"
        ) from None
    remove_stale(resolved)
    return resolved


def _check_existing(target: Path, shown: str, overwrite: bool) -> None:
    try:
        mode = target.stat().st_mode
    except OSError as err:  # a dangling link, or a path the OS refuses to look at
        raise ConfigError(f"{shown}: unusable ({err.strerror or err}) — choose a new folder") from None
    if not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else "a device, FIFO or socket"
        raise ConfigError(f"{shown} is {what}, not a folder — give the path of a new folder")
    try:
        held = any(target.iterdir())
    except OSError as err:
        raise ConfigError(f"{shown}: cannot be read ({err.strerror or err}) — choose a new folder") from None
    if held and not overwrite:
        raise ConfigError(
            f"{shown} already holds files — choose a new folder, or pass infer.overwrite=true to "
            "replace an earlier glmtune export there"
        )
    if held and not (target / MARKER).is_file():
        raise ConfigError(
            f"{shown} holds files that no glmtune export wrote (no {MARKER}): infer.overwrite=true "
            "replaces only an earlier export — choose a new folder, or empty this one yourself"
        )


def mark_export(folder: Path, kind: str, **about) -> None:
    """The marker of a folder an export is building: this process (for remove_stale) and what it holds."""
    record = {
        "written_by": "glmtune",
        "kind": kind,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": round(time.time(), 3),
        **{k: str(v) for k, v in about.items() if v is not None},
    }
    (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _writer_alive(marker: Path) -> bool:
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if record.get("host") != socket.gethostname():
        return True  # another machine's export (a shared disk): not ours to judge
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except (OSError, ValueError, OverflowError):
        return False
    return True


def remove_stale(target: Path) -> list[Path]:
    """Delete the temporary folders of exports into `target` that were killed mid-write; returns them."""
    removed = []
    for tmp in target.parent.glob(f".{target.name}.*.tmp"):
        if not tmp.is_dir() or tmp.is_symlink():
            continue
        marker = tmp / MARKER
        if marker.is_file() and _writer_alive(marker):
            continue
        if not marker.is_file() and time.time() - tmp.stat().st_mtime < STALE_S:
            continue  # just created by an export that has not written its marker yet
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


@contextlib.contextmanager
def writing_export(key: str, target: Path) -> Iterator[None]:
    """A full disk (or quota) while the block writes the export: one line naming the target, nothing of it kept."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only a full disk becomes the one line; anything else re-raises
        if not is_disk_full(err):
            raise
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"disk full or over quota writing {key}={target} ({reason}) — nothing of the export was "
            f"kept; free space in {target.parent} or choose another folder, then re-run"
        ) from None
