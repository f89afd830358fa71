"""Checkpoints that are either complete or ignored, rotated only after the new one is complete.

The HF Trainer (4.40) writes `checkpoints/checkpoint-<step>/` file by file with plain writes: a run killed
mid-save leaves a folder with a 0-byte `optimizer.pt` and no `trainer_state.json`, which the Trainer's own
`get_last_checkpoint` would pick. Here a checkpoint counts only once every rank finished writing, every file
in it was fsynced, and then a marker file `COMPLETE` (written last, atomically) names its step. Resume
only ever starts from a folder with that marker; folders without it are deleted before training restarts. The
marker records each file's size and sha256: a file damaged after the save (cut short by a copy, overwritten) is
named before the resume loads it, instead of failing inside the Trainer.
The callback that writes the marker is in saving.py; this module stays light (no Trainer import) for the CLI.

Rotation is glmtune's, not the Trainer's `save_total_limit`: the Trainer deletes old checkpoints before its
caller knows the new one is whole, so a crash mid-save could leave no complete checkpoint at all.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from ..config.units import MIB
from ..rundir.atomic import fsync_tree, write_json

MARKER = "COMPLETE"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(folder: Path) -> int | None:
    match = _NAME.match(folder.name)
    return int(match.group(1)) if match else None


def all_checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest step first (by number, not mtime: mtimes lie on network disks)."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def is_complete(folder: Path) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()).get("step") == checkpoint_step(folder)
    except (OSError, ValueError, AttributeError):
        return False


def last_complete(output_dir: Path) -> Path | None:
    complete = [p for p in all_checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def remove_incomplete(output_dir: Path) -> list[Path]:
    """Delete checkpoint folders without the marker (a save that was killed); returns what went."""
    gone = [p for p in all_checkpoints(output_dir) if not is_complete(p)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def mark_complete(folder: Path, step: int) -> None:
    """The marker, with the size and sha256 of every file in the folder (a LoRA checkpoint is a few times the
    adapter's size: tens of MB for a 9B model), so a file damaged later is named at the resume (damage)."""
    fsync_tree(folder)  # the Trainer's and DeepSpeed's plain writes reach the disk before the marker does
    write_json(folder / MARKER, {"step": step, "files": _checksums(folder)})


def _checksums(folder: Path) -> dict[str, str]:
    found = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(MIB), b""):
                digest.update(block)
        found[file.relative_to(folder).as_posix()] = f"{file.stat().st_size} {digest.hexdigest()}"
    return found


def damage(folder: Path) -> str | None:
    """What differs in a complete checkpoint from what its marker recorded (None: as saved, or a marker from
    before the checksums). Files added since (none of glmtune's) are not looked at."""
    try:
        recorded = json.loads((folder / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not recorded:
        return None
    now = _checksums(folder)
    changed = [name for name in recorded if now.get(name) != recorded[name]]
    return (
        (
            f"{', '.join(changed[:3])} {'is missing or differs' if len(changed) == 1 else 'are missing or differ'} "
            "from what was saved"
        )
        if changed
        else None
    )


def rotate(output_dir: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (0 = keep all); older complete ones are deleted."""
    complete = [p for p in all_checkpoints(output_dir) if is_complete(p)]
    old = complete[:-keep] if keep > 0 else []
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


def allow_numpy_rng_state() -> None:
    """Let torch.load(weights_only=True) read the Trainer's rng_state.pth.

    It pickles `np.random.get_state()`: a tuple with a uint32 ndarray, which weights_only (the default
    from torch 2.6) refuses. Allow-listing exactly the numpy types that state needs keeps every other
    pickle refused, instead of turning weights_only off for the whole resume."""
    import numpy as np
    import torch

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    types = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    torch.serialization.add_safe_globals(types)
