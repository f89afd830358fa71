"""One run per run dir: a lock held for the whole run, and what to do with what an earlier run left.

    python -m glmtune hydra.run.dir=runs/a ...        # fresh dir: start; interrupted run there: resume
    python -m glmtune hydra.run.dir=runs/a train.resume=restart   # old contents moved aside, step 0
    python -m glmtune hydra.run.dir=runs/a train.resume=always train.max_steps=2000   # continue a finished run

The lock is an flock on `<run dir>/.lock.rank<N>`, one per rank, held until the process exits: a second
launch into a dir in use fails on its own rank's file at once (exit 2, naming the holder) instead of
interleaving checkpoints with the first. The kernel drops the lock when the holder dies, even by SIGKILL,
so a stale lock never needs cleaning up.

`run_state.json` (rank 0, atomic) says what the dir holds: status running | interrupted | diverged | failed |
done, the last step, the config the run was started with, and the plan's final choices (so a resume trains
with the exact micro-batch and dtype of the first launch, without probing again).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .atomic import is_disk_full, read_jsonl, write_json, write_text

STATE = "run_state.json"
RESUME_MODES = ("auto", "always", "restart")
FINISHED = ("done", "diverged")  # a resume would not change the outcome: refused unless told
# Keys that may change between a run and its resume: how long to train and how often to save. Any other
# difference (data, LoRA, learning rate, ...) would splice two different runs into one curve.
RESUMABLE_CHANGES = (
    "train.resume",
    "train.max_steps",
    "train.num_epochs",
    "train.save_steps",
    "train.save_minutes",
    "train.keep_checkpoints",
    "train.logging_steps",
)
# The memory levers: they change where and how fast the run trains, never what it computes (the loss is the mean
# over each optimizer step's target tokens, train/steps.py), so a resume may move to another card, GPU count or
# engine. The micro-batch and accumulation may change as long as the global batch (micro x accumulation x
# processes, recorded at the first launch) stays; modes/run.py checks that and re-plans for the new hardware.
MEMORY_LEVERS = (
    "train.per_device_batch_size",
    "train.grad_accum",
    "train.eval_batch_size",
    "train.gradient_checkpointing",
    "train.precision",
    "train.compile",
    "train.packed_attention",
    "data.packing",
    "data.pack_length",
)  # packing: rows of the same examples (data/packing.py)
MEMORY_LEVER_GROUPS = ("hw.", "dist.", "probe.")  # the card preset, process counts and engine, the probe
# What a training launch writes before run_state.json: the plan's files and the probe's report.
BEFORE_TRAINING = {".hydra", "plan.json", "versions.json", "probe.json"}
_OURS = (".lock.rank", "rank")  # lock files and Hydra's per-rank logs of the current launch


class RunDirLock:
    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / f".lock.rank{rank}"
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent}: run dir is in use by {holder} — wait for that run to end, "
                "or give this one another hydra.run.dir (or none: every launch gets its own)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self.fd = fd
        return self

    def held(self) -> bool:
        """Whether a live process holds this lock (the kernel drops an flock when its holder dies, even by
        SIGKILL); probed without taking it for longer than the probe."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def discard(self) -> None:
        """Release and remove the lock file of a launch that never started (bad input): held by us, nobody else
        can be using it, and the run dir it sat in may then be removed as empty."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self.fd = None


@dataclass
class Start:
    resume_from: Path | None = None  # the complete checkpoint to resume from; None = step 0
    choices: dict | None = None  # the first launch's final plan choices, when resuming
    note: str | None = None  # one line for the console about what was found
    levers_changed: list[str] | None = None  # memory levers set otherwise than at the first launch


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / STATE).read_text())
    except (OSError, ValueError):
        return None


def write_state(run_dir: Path, **fields: Any) -> None:
    """Merge `fields` into run_state.json (rank 0 only; the caller checks).

    On a full disk the atomic write (a new file, then a rename) has no room, and the dir would keep saying
    `running` for a run that failed: the state is then rewritten in place, without indentation, which is
    shorter than the indented file it replaces, so it needs no new blocks (on a copy-on-write filesystem it
    fails like the first write, and the original error is reported)."""
    state = read_state(run_dir) or {}
    state.update(fields, updated=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        write_json(run_dir / STATE, state)
    except OSError as err:
        if not (is_disk_full(err) and (run_dir / STATE).is_file()):
            raise
        data = json.dumps(state, separators=(",", ":")).encode() + b"\n"
        try:
            with open(run_dir / STATE, "r+b") as f:
                f.write(data)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            raise err from None


def flatten(config: dict) -> dict[str, Any]:
    """The composed config as dotted keys (`train.grad_accum`) and their leaf values."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}{key}.", sub)
        else:
            flat[prefix.rstrip(".")] = value

    walk("", config)
    return flat


def comparable(config: dict) -> dict[str, Any]:
    """The composed config flattened to dotted keys, without the keys a resume may change."""
    return {k: v for k, v in flatten(config).items() if k not in RESUMABLE_CHANGES and not is_memory_lever(k)}


def is_memory_lever(key: str) -> bool:
    return key in MEMORY_LEVERS or key.startswith(MEMORY_LEVER_GROUPS)


def changed_levers(before: dict, now: dict) -> list[str]:
    """The memory levers whose values differ between two composed configs (dotted keys)."""
    a, b = flatten(before), flatten(now)
    return sorted(k for k in a.keys() | b.keys() if is_memory_lever(k) and a.get(k) != b.get(k))


def earlier_files(run_dir: Path) -> list[str]:
    """What an earlier launch left: every entry except this launch's lock files, logs and moved-aside dirs."""
    if not run_dir.is_dir():
        return []
    return sorted(
        p.name for p in run_dir.iterdir() if not p.name.startswith(_OURS) and not p.name.startswith("replaced-")
    )


def move_aside(run_dir: Path, names: list[str]) -> Path:
    """Move `names` into `<run dir>/replaced-<time>/` (one rename each, same filesystem): nothing deleted,
    nothing mixed with the new run's files."""
    target = run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    target.mkdir()
    for name in names:
        os.replace(run_dir / name, target / name)
    return target


def decide(run_dir: Path, mode: str, config: dict, last_checkpoint: Path | None, leader: bool) -> Start:
    """What this launch does with `run_dir`; raises ConfigError (exit 2) where it must not touch it.

    `last_checkpoint` is the newest *complete* checkpoint there. Only the leader (rank 0) refuses or moves
    files. The other ranks may look while the leader is already writing the new run's files, so they never
    refuse (where the leader refuses, it exits 2 and the launcher stops them); what they need from here, the
    checkpoint to resume from, is the same whether they look before or after the leader's writes."""
    try:
        return _decide(run_dir, mode, config, last_checkpoint, leader)
    except ConfigError:
        if leader:
            raise
        return Start()


def _decide(run_dir: Path, mode: str, config: dict, last_checkpoint: Path | None, leader: bool) -> Start:
    state, found = read_state(run_dir), earlier_files(run_dir)
    if state is None and set(found) <= BEFORE_TRAINING:  # a launch that stopped before training (exit 3, bad
        found = []  # input after the plan): nothing of a run; this launch rewrites those files
    if mode == "restart" or not found:
        if found and leader:
            return Start(note=f"train.resume=restart: the earlier run's files moved to {move_aside(run_dir, found)}")
        return Start()
    if state is None and (run_dir / STATE).exists():  # a glmtune run whose state file was damaged
        raise ConfigError(
            f"{run_dir / STATE}: unreadable (not JSON) — without it the run cannot be resumed; pass "
            "train.resume=restart to move the run's files aside and start over, or use another "
            "hydra.run.dir"
        )
    if state is None:
        raise ConfigError(
            f"{run_dir}: run dir already holds files that are not a glmtune run ({', '.join(found[:4])}"
            f"{', …' if len(found) > 4 else ''}) — choose another hydra.run.dir, or pass "
            "train.resume=restart to move them aside"
        )
    if state.get("mode", "train") != "train":
        raise ConfigError(
            f"{run_dir}: run dir holds a mode={state['mode']} run — use another hydra.run.dir, or pass "
            "train.resume=restart to move its files aside"
        )
    if state.get("status") in FINISHED and mode != "always":
        raise ConfigError(
            f"{run_dir}: run dir holds a {'finished' if state['status'] == 'done' else 'diverged'} run "
            f"(step {state.get('step', '?')}) — pass train.resume=always to continue it from its last "
            "checkpoint (e.g. with a larger train.max_steps), train.resume=restart to start over "
            "(its files are moved aside), or use another hydra.run.dir"
        )
    before, now = comparable(state.get("config", {})), comparable(config)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if changed:
        shown = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
        raise ConfigError(
            f"{run_dir}: run dir holds a run with another config ({shown}"
            f"{', …' if len(changed) > 3 else ''}) — a resume keeps the "
            "model, LoRA, data, lengths and learning settings (only memory levers such as +hw=, dist.*, "
            "the micro-batch and accumulation may change): repeat the original command to resume it, "
            "pass train.resume=restart to start over, or use another hydra.run.dir"
        )
    if last_checkpoint is None:
        if mode == "always":
            raise ConfigError(
                f"{run_dir}: train.resume=always, but the run dir has no complete checkpoint — use train.resume=restart"
            )
        if leader:
            return Start(
                note=f"no complete checkpoint in {run_dir}: starting at step 0 (the earlier run's files "
                f"moved to {move_aside(run_dir, found)})"
            )
        return Start()
    return Start(
        resume_from=last_checkpoint,
        choices=state.get("choices"),
        levers_changed=changed_levers(state.get("config", {}), config),
        note=f"resuming from {last_checkpoint} (step {last_checkpoint.name.rsplit('-', 1)[-1]}, "
        f"status was {state.get('status')})",
    )


def trim_metrics(path: Path, step: int) -> None:
    """metrics.jsonl after a resume from `step`: the lines logged after that step were by the interrupted
    launch and will be logged again, so they go (an atomic rewrite)."""
    if path.exists():
        rows = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
        write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
