"""Durable runs through the real command line: a signal saves and a re-run resumes to the same adapter, a save
killed half-way is never resumed from, run dirs never mix, a diverged run fails, a full disk is one line.

The reference for "same" is an uninterrupted run of the same command: the resumed run must log the same loss
at every step and end with the same adapter fingerprint (sha256 of every LoRA tensor).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO
from helpers.files import metrics_rows

from glmtune.models.presets import ensure_tiny
from glmtune.train.checkpoints import is_complete

STEPS = 30
# All-linear adapters at a high learning rate: the loss moves a lot per step, so a wrong data order, RNG state,
# optimizer or scheduler state after the resume shows up in the curve at once.
ARGS = [
    "lora=all_linear",
    "train.learning_rate=1e-2",
    f"train.max_steps={STEPS}",
    "train.logging_steps=1",
    "probe.enabled=false",
    f"data.train_file={REPO / 'data/samples/train.jsonl'}",
    "data.val_file=null",
]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def start(*args, cwd=REPO, env=ENV) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "glmtune", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(*args, **kw):
    return finish(start(*args, **kw))


def losses(run_dir: Path) -> dict[int, float]:
    rows = metrics_rows(run_dir)
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for(condition, proc: subprocess.Popen, timeout=300.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def logged_steps(run_dir: Path) -> int:
    try:
        return sum('"loss"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    # A line may start with a progress bar's last update (tqdm ends its lines with \r, not \n).
    # glmtune's one line: an error, or a stop that saved its checkpoint ("glmtune: stopped by ...", not an error)
    lines = [
        line[m.start() :] for line in stderr.splitlines() if (m := re.search(r"glmtune: (error: |stopped by )", line))
    ]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ensure_tiny("glm4")
    out = tmp_path_factory.mktemp("reference") / "run"
    code, stdout, stderr = run(*ARGS, f"hydra.run.dir={out}")
    assert code == 0, stderr[-3000:]
    return out, losses(out), json.loads((out / "metrics.json").read_text())["adapter_sha256"]


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_resumes_to_the_same_adapter(tmp_path, reference):
    ref_dir, ref_losses, ref_print = reference
    out = tmp_path / "run"
    proc = start(*ARGS, f"hydra.run.dir={out}")
    wait_for(lambda: logged_steps(out) >= 3, proc, what="three logged steps")
    proc.send_signal(signal.SIGTERM)
    code, _, stderr = finish(proc)
    assert code == 7, stderr[-3000:]
    line = error_line(stderr)
    assert "stopped by SIGTERM at step" in line and "re-run the same command" in line
    stopped_at = int(line.split("at step ")[1].split(":")[0])
    assert 3 <= stopped_at < STEPS
    checkpoint = out / "checkpoints" / f"checkpoint-{stopped_at}"
    assert is_complete(checkpoint)
    assert json.loads((out / "run_state.json").read_text())["status"] == "interrupted"
    assert not (out / "adapter").exists()

    code, stdout, stderr = run(*ARGS, f"hydra.run.dir={out}")
    assert code == 0, stderr[-3000:]
    assert f"resuming from {checkpoint}" in stdout
    assert losses(out) == ref_losses  # every step, exactly: data order, RNG, optimizer and scheduler restored
    assert json.loads((out / "metrics.json").read_text())["adapter_sha256"] == ref_print

    # A finished dir is refused (exit 2) unless told; restart moves the old files aside, never mixes them.
    code, _, stderr = run(*ARGS, f"hydra.run.dir={out}")
    assert code == 2 and "holds a finished run" in error_line(stderr) and "train.resume=restart" in stderr
    code, stdout, stderr = run(*ARGS, "train.max_steps=2", "train.resume=restart", f"hydra.run.dir={out}")
    assert code == 0, stderr[-3000:]
    aside = [p for p in out.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and (aside[0] / "adapter").is_dir() and (aside[0] / "checkpoints").is_dir()
    assert sorted(losses(out)) == [1, 2] and sorted(losses(aside[0])) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_save_killed_half_way_is_never_resumed_from(tmp_path, reference):
    """SIGKILL while checkpoint-4 is being written. The save is held mid-way on purpose: its optimizer.pt is a
    FIFO, so torch.save blocks after the adapter files are written and before trainer_state.json."""
    from transformers.trainer_utils import get_last_checkpoint

    ref_dir, ref_losses, ref_print = reference
    out = tmp_path / "run"
    args = [*ARGS, "train.save_steps=2", "train.keep_checkpoints=5", f"hydra.run.dir={out}"]
    proc = start(*args)
    wait_for(lambda: (out / "run_state.json").exists(), proc, what="the run to start")
    held = out / "checkpoints" / "checkpoint-4"
    held.mkdir(parents=True)
    os.mkfifo(held / "optimizer.pt")
    wait_for(lambda: (held / "adapter_model.safetensors").exists(), proc, what="the save of step 4")
    time.sleep(0.5)
    assert proc.poll() is None  # blocked inside the save
    proc.kill()
    proc.communicate()
    assert is_complete(out / "checkpoints" / "checkpoint-2") and not is_complete(held)
    assert get_last_checkpoint(str(out / "checkpoints")) == str(held)  # what the Trainer alone would resume from
    state = json.loads((out / "run_state.json").read_text())  # nothing ran after the kill: the last save wrote it
    assert (state["step"], state["checkpoint"]) == (2, str(out / "checkpoints" / "checkpoint-2")), state

    code, stdout, stderr = run(*args)
    assert code == 0, stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-2'}" in stdout
    assert losses(out) == ref_losses
    assert json.loads((out / "metrics.json").read_text())["adapter_sha256"] == ref_print
    assert all(is_complete(p) for p in (out / "checkpoints").iterdir())


@pytest.mark.slow
def test_two_launches_get_two_dirs_and_a_dir_in_use_is_refused(tmp_path):
    ensure_tiny("glm4")
    # Without hydra.run.dir: launched together, each gets its own dir (outputs/ is relative to the cwd).
    short = [*ARGS, "train.max_steps=1"]
    pair = [start(*short, cwd=tmp_path), start(*short, cwd=tmp_path)]
    results = [finish(p) for p in pair]
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    dirs = sorted(p.parent for p in (tmp_path / "outputs").rglob("adapter"))
    assert len(dirs) == 2 and dirs[0] != dirs[1]
    # a long path wraps the closing line (never inside the path): read it as one line
    said = [" ".join(r[1].split()).split("adapter saved to ")[1].split()[0].rstrip(";") for r in results]
    assert set(said) == {str(d / "adapter") for d in dirs}

    # With the same hydra.run.dir: the second launch exits 2 while the first holds the lock; Ctrl-C (SIGINT)
    # then stops the first with a complete checkpoint.
    out = tmp_path / "shared"
    first = start(*ARGS, "train.max_steps=100000", f"hydra.run.dir={out}")
    wait_for(lambda: logged_steps(out) >= 1, first, what="the first launch to train")
    code, _, stderr = run(*ARGS, f"hydra.run.dir={out}")
    assert code == 2 and f"{out}: run dir is in use by pid {first.pid}" in error_line(stderr)
    first.send_signal(signal.SIGINT)
    code, _, stderr = finish(first)
    assert code == 7 and "stopped by SIGINT at step" in error_line(stderr)


@pytest.mark.slow
def test_ctrl_c_before_training_is_one_line(tmp_path):
    ensure_tiny("glm4")
    proc = start(*ARGS, f"hydra.run.dir={tmp_path / 'run'}")
    wait_for(lambda: (tmp_path / "run" / ".lock.rank0").exists(), proc, what="the lock")
    proc.send_signal(signal.SIGINT)
    code, _, stderr = finish(proc)
    assert code == 7 and "stopped by SIGINT" in error_line(stderr)


@pytest.mark.slow
def test_a_diverged_run_fails_with_exit_8_and_no_adapter(tmp_path):
    ensure_tiny("glm4")
    out = tmp_path / "run"
    code, _, stderr = run(
        "lora=all_linear",
        "train.learning_rate=1e30",
        "train.max_steps=10",
        "probe.enabled=false",
        "data.val_file=null",
        "train.save_steps=1",
        f"hydra.run.dir={out}",
    )
    assert code == 8, stderr[-3000:]
    line = error_line(stderr)
    assert "training diverged at step" in line
    assert "lower train.learning_rate (now 1e+30), e.g. train.learning_rate=0.0001" in line  # a sane value
    assert not (out / "adapter").exists() and not (out / "metrics.json").exists()
    assert json.loads((out / "run_state.json").read_text())["status"] == "diverged"
    # Only checkpoints saved before the divergence exist, and their weights are finite.
    from safetensors.torch import load_file

    for checkpoint in (out / "checkpoints").glob("checkpoint-*"):
        assert all(t.isfinite().all() for t in load_file(checkpoint / "adapter_model.safetensors").values())


def can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unprivileged user+mount namespaces for a small tmpfs")
def test_a_full_disk_mid_run_is_one_line_and_leaves_no_empty_files(tmp_path):
    """The run dir is on a 32 MiB tmpfs (in a private mount namespace); once the first checkpoint is complete, a
    filler file takes every free byte, so the next checkpoint or log write fails with ENOSPC."""
    ensure_tiny("glm4")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    command = " ".join(
        [sys.executable, "-m", "glmtune", *ARGS, "train.max_steps=100000", "train.save_steps=1", f"hydra.run.dir={out}"]
    )
    script = (
        f"mount -t tmpfs -o size=32m tmpfs {disk} && ({command} & pid=$!; "
        f'while [ -z "$(find {out} -name COMPLETE 2>/dev/null)" ] && kill -0 $pid 2>/dev/null; do sleep 0.05; '
        "done; "
        f"cat /dev/zero > {disk}/filler 2>/dev/null; wait $pid; echo exit=$? >&2; "
        f"for f in $(find {out} -name '*.json' -o -name '*.yaml'); do [ -s $f ] || echo EMPTY $f >&2; done; "
        f"find {out}/checkpoints -name COMPLETE | sed 's/^/MARKED /' >&2; "
        f"grep -o '\"status\": *\"[a-z]*\"' {out}/run_state.json | sed 's/^/STATE /' >&2)"
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert "exit=2" in proc.stderr, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "disk full" in line and "re-run the same command" in line
    assert "EMPTY" not in proc.stderr  # every run file is whole or absent: no 0-byte json/yaml
    assert "MARKED" in proc.stderr  # the complete checkpoints from before the disk filled are still marked
    assert "STATE" in proc.stderr and '"failed"' in proc.stderr.split("STATE ")[1]  # not left at "running"
    assert "it resumes from" in line and "/checkpoints/checkpoint-" in line  # names the checkpoint it resumes from


def torchrun(*args, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "glmtune",
            *args,
        ],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def last_fingerprints(run_dir: Path) -> dict[int, str]:
    """Each rank's last logged adapter fingerprint (the rank logs keep every launch's lines)."""
    from helpers.launch import FINGERPRINT

    found = {}
    for log in run_dir.glob("rank*.log"):
        for digest, rank, _ in FINGERPRINT.findall(log.read_text()):
            found[int(rank)] = digest
    return found


@pytest.mark.slow
def test_zero3_two_ranks_sigterm_then_resume_matches_the_uninterrupted_run(tmp_path):
    from helpers.launch import free_port

    ensure_tiny("glm4")
    args = [
        "dist=zero3",
        *[a for a in ARGS if not a.startswith("train.max_steps")],
        "train.max_steps=12",
        "train.per_device_batch_size=2",
    ]
    ref = tmp_path / "reference"
    code, _, stderr = finish(torchrun(*args, f"hydra.run.dir={ref}", port=free_port()))
    assert code == 0, stderr[-4000:]
    ref_prints = last_fingerprints(ref)
    assert set(ref_prints) == {0, 1} and ref_prints[0] == ref_prints[1]

    out = tmp_path / "run"
    proc = torchrun(*args, f"hydra.run.dir={out}", port=free_port())
    wait_for(lambda: logged_steps(out) >= 3, proc, what="three logged steps")
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    _, _, stderr = finish(proc)
    # Rank 0 speaks on the console; rank 1 writes the same step's line to its own log (issue 21).
    stops = [line for line in stderr.splitlines() if "glmtune: stopped by SIGTERM at step" in line]
    assert len(stops) == 1, stderr[-4000:]
    stopped_at = int(stops[0].split("at step ")[1].split(":")[0])
    assert f"stopped by SIGTERM at step {stopped_at}:" in (out / "rank1.log").read_text()
    assert stopped_at < 12 and is_complete(out / "checkpoints" / f"checkpoint-{stopped_at}")

    code, stdout, stderr = finish(torchrun(*args, f"hydra.run.dir={out}", port=free_port()))
    assert code == 0, stderr[-4000:]
    assert "resuming from" in stdout
    assert losses(out) == losses(ref)
    assert last_fingerprints(out) == ref_prints
