"""Which run the same command resumes, and the command that resumes it.

    glmtune train.num_epochs=3          # SIGTERM: exit 7, a checkpoint, and the line names a resume command
    glmtune train.num_epochs=3          # the same command: "resuming outputs/2026-11-23/20-51-07.412-3f2a from step 12"

Hydra gives every launch a fresh, unique run dir (launch.run_name), so on its own the same command would start
over. Before the run takes its lock, `redirect` looks under the outputs root for the newest run of the same
composed config (`lock.comparable`: the keys a resume may change aside) that stopped before it finished
(status interrupted; running or failed with no process holding its lock: a crash or a kill) and moves the
launch there; `lock.decide` then resumes it from its last complete checkpoint, as with `hydra.run.dir=`.

Only a run dir glmtune named itself is redirected (a date and time with a random id, or a launcher's random
rendezvous id): `hydra.run.dir=`, `GLMTUNE_RUN_ID`, a torchrun `--rdzv_id` or a SLURM job name their own dir,
and `train.resume=restart` always starts a new run. Every rank looks with its own rank's lock file, and the
order is by the run's start time recorded in run_state.json, which a resume never rewrites, so all ranks of
one launch pick the same dir while rank 0 already writes into it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..launch import rank, world_size
from .fingerprint import LEGACY, legacy_fingerprint, weight_fingerprint
from .lock import RunDirLock, comparable, read_state

RESUMABLE = ("interrupted", "running", "failed")  # running/failed: only when no process holds the lock
# Names glmtune generates under the outputs root: DATE/TIME.mmm-<4 hex> (one process), DATE/torchrun-<8 hex>
# (torchrun --standalone), DATE/deepspeed-<8 hex> (scripts/deepspeed_launch.sh without RUN_ID).
GENERATED = re.compile(r"^\d{4}-\d\d-\d\d/(\d\d-\d\d-\d\d\.\d{3}-[0-9a-f]{4}|(torchrun|deepspeed)-[0-9a-f]{8})$")


def outputs_root() -> Path:
    return (Path.cwd() / "outputs").resolve()


def generated(run_dir: Path) -> bool:
    """Whether `run_dir` is a name glmtune made up for this launch (not one the user or a scheduler chose)."""
    try:
        return bool(GENERATED.match(run_dir.resolve().relative_to(outputs_root()).as_posix()))
    except ValueError:  # not under ./outputs
        return False


def unfinished_run(config: dict, this_rank: int, root: Path | None = None) -> Path | None:
    """The newest run under the outputs root of the same config that stopped before it finished, or None."""
    root = root or outputs_root()
    want, found = comparable(config), []
    for state_file in [*root.glob("*/run_state.json"), *root.glob("*/*/run_state.json")]:
        run_dir, state = state_file.parent, read_state(state_file.parent) or {}
        if state.get("mode", "train") != "train" or state.get("status") not in RESUMABLE:
            continue
        if comparable(state.get("config", {})) != want or RunDirLock(run_dir, this_rank).held():
            continue
        started = state.get("started")  # seconds since the epoch; absent in runs older than this field
        found.append((started if isinstance(started, (int, float)) else 0.0, run_dir.as_posix(), run_dir))
    return max(found)[2] if found else None


def redirect(fresh: Path, config: dict, multirun: bool) -> Path:
    """The run dir this launch uses: `fresh` (Hydra's), or the unfinished run of the same command it resumes.

    Moving to another dir points this rank's log file there and removes what Hydra made for `fresh`."""
    train = config.get("train", {})
    if (
        multirun
        or config.get("mode", "train") != "train"
        or train.get("resume") == "restart"
        or not generated(fresh)
        or (fresh / "run_state.json").exists()
    ):
        return fresh
    found = unfinished_run(config, rank())
    if found is None or found.resolve() == fresh.resolve():
        return fresh
    for handler in logging.getLogger().handlers:  # Hydra's per-rank file handler (conf/config.yaml)
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == fresh.resolve():
            handler.close()
            handler.baseFilename = str(found.resolve() / Path(handler.baseFilename).name)
            handler.stream = handler._open()  # noqa: SLF001 - FileHandler's own way to reopen, mode "a"
    return found


def resume_command(run_dir: Path, overrides: list[str]) -> str:
    """A command that resumes `run_dir` when pasted as it is: this launch's command line with the run dir
    named (so it works from any folder of the same data paths, and whatever else ran since)."""
    kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "train.resume="))]
    args = [f"hydra.run.dir={run_dir.resolve()}", *kept]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    if world_size() == 1:
        launcher = [sys.executable, "-m", "glmtune"]
    elif os.environ.get("TORCHELASTIC_RUN_ID") and local == world_size():  # one node: torchrun --standalone
        launcher = [
            sys.executable,
            "-m",
            "glmtune.supervise",
            "torchrun",
            "--standalone",
            "--nproc_per_node",
            str(local),
            "-m",
            "glmtune",
        ]  # as scripts/torchrun.sh runs it
    else:
        return f"re-run the same launch command on every node (it finds {run_dir})"
    return f"cd {shlex.quote(os.getcwd())} && " + " ".join(shlex.quote(a) for a in [*launcher, *args])


def input_fingerprints(splits: dict[str, Any], model_dir: Path) -> dict[str, str]:
    """What a resume must find unchanged besides the config, by name: each data file's content and the tokenizer
    files (sha256, as its cache entry recorded them: no second read), and each weight file's sampled content
    fingerprint (fingerprint.py: header, small tensors and evenly spread blocks; hashing 18 GB of weights
    whole would add minutes to every launch)."""
    found: dict[str, str] = {}
    for key, split in splits.items():
        if split is not None:
            meta = json.loads((Path(split.path) / "meta.json").read_text())
            found[f"{key} {meta['file']}"] = f"sha256 {meta['data_sha256']}"
            found[f"the tokenizer files in {model_dir}"] = f"sha256 {meta['tokenizer_sha256']}"
    for weights in sorted(Path(model_dir).iterdir()):
        if weights.suffix in (".safetensors", ".bin") and weights.is_file():
            found[f"weight file {weights}"] = weight_fingerprint(weights)
    return found


def check_inputs(run_dir: Path, now: dict[str, str]) -> None:
    """Refuse (exit 2) to resume `run_dir` on other data, tokenizer or weights than it started with."""
    before = (read_state(run_dir) or {}).get("inputs")
    if before is None:  # a run from before inputs were recorded: nothing to compare with
        return
    changed = sorted(
        k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and not _same_legacy(k, before.get(k))
    )
    if changed:
        raise ConfigError(
            f"{run_dir}: cannot resume: {'; '.join(changed[:3])}{' …' if len(changed) > 3 else ''} "
            "changed since the interrupted run started — restore the original files to resume, or "
            "start over with train.resume=restart (or another hydra.run.dir)"
        )


def _same_legacy(key: str, recorded: str | None) -> bool:
    """A run recorded before content fingerprints holds a weight file's size and mtime: compared as such, so
    it still resumes (with the old, weaker check)."""
    if not (recorded and LEGACY in recorded and key.startswith("weight file ")):
        return False
    path = Path(key[len("weight file ") :])
    return path.is_file() and legacy_fingerprint(path) == recorded


def refuse_training_run(run_dir: Path, mode: str) -> None:
    """mode=plan/probe into a training run's dir would replace its .hydra/, plan.json and versions.json with files
    that describe another launch than the adapter beside them: refused (exit 2)."""
    if read_state(run_dir) is not None:
        raise ConfigError(
            f"{run_dir}: run dir holds a training run; mode={mode} would overwrite its config and plan "
            "files — give this launch another hydra.run.dir (or none)"
        )
