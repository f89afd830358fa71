"""Where infer.merge_to may write (glmtune/infer/targets.py), through the command: infer.overwrite replaces an
earlier glmtune export and nothing else, a merge killed mid-write leaves nothing the next merge keeps, and a
read-only or full disk is one line naming the target. The refusals of targets that hold an input (the parents of
model.path, the adapter, the prompts file and the run dir; a file; a device; /proc; a missing parent) are rows of
tests/e2e/test_bad_inputs.py, each with every file around it byte-identical afterwards."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.cli import glmtune_in_process
from helpers.files import run_in_tmpfs

from glmtune.infer.targets import MARKER
from glmtune.models.presets import ensure_tiny


def merge(target, run_dir, *extra):
    return glmtune_in_process("mode=infer", f"infer.merge_to={target}", f"hydra.run.dir={run_dir}", *extra)


def leftover(folder, name, pid=None, age_s=0.0):
    """A hidden temporary folder as an export leaves it when killed mid-write (`pid`: its writer's, in the marker)."""
    tmp = folder / f".merged.{name}.tmp"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 4096)  # half a merge
    if pid is not None:
        (tmp / MARKER).write_text(
            json.dumps({"written_by": "glmtune", "kind": "merged", "pid": pid, "host": os.uname().nodename})
        )
    if age_s:
        os.utime(tmp, (time.time() - age_s, time.time() - age_s))
    return tmp


def test_overwrite_replaces_an_earlier_export_and_a_killed_merges_leftovers_go(tmp_path):
    merged = tmp_path / "merged"
    first = merge(merged, tmp_path / "a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((merged / MARKER).read_text())["kind"] == "merged" and (merged / "model.safetensors").is_file()
    (merged / "stale.txt").write_text("from the first export\n")

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a writer that no longer exists
    killed, old = leftover(tmp_path, "k1ll3d", pid=gone.pid), leftover(tmp_path, "0ld", age_s=3600)
    running = leftover(tmp_path, "runn1ng", pid=os.getpid())  # an export still writing: not touched
    again = merge(merged, tmp_path / "b")
    assert again.returncode == 2 and "already holds files" in again.stderr  # never replaced without the flag
    again = merge(merged, tmp_path / "c", "infer.overwrite=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (merged / "stale.txt").exists() and (merged / "model.safetensors").is_file()  # replaced whole
    assert not killed.exists() and not old.exists() and running.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [running.name]


@pytest.mark.slow
def test_a_full_or_read_only_disk_is_one_line_naming_the_target(tmp_path):
    """A tmpfs too small for the tiny model's weights (~1 MB), then the same tmpfs read-only."""
    ensure_tiny("glm4")
    command = f"{sys.executable} -m glmtune mode=infer infer.merge_to=$DISK/merged hydra.run.dir={tmp_path}/run"
    proc = run_in_tmpfs(
        f"{command}1; echo EXIT=$?; mount -o remount,ro $DISK && {command}2; echo EXIT=$?", size="300k", timeout=600
    )
    exits = [line for line in proc.stdout.splitlines() if line.startswith("EXIT=")]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glmtune: error: ")]
    assert exits == ["EXIT=2", "EXIT=2"] and len(errors) == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    full, read_only = errors
    assert "disk full" in full and "infer.merge_to=" in full and "/merged (" in full and str(tmp_path) not in full
    assert "infer.merge_to=" in read_only and "cannot write in" in read_only and "Read-only file system" in read_only
