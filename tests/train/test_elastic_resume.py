"""A run stopped on one machine continues on another: other process counts and engines, the same result.

The uninterrupted 2-process run (1 example a micro-batch x 2 accumulated x 2 processes) is first checked against
the same global batch split otherwise: 4 x 1 x 1 process, 2 x 1 x 2 processes and ZeRO-3 1 x 2 x 2 log the same
loss and gradient norm at every step and end, after 14 steps (one epoch boundary crossed), with its adapter.
Each interrupted run is stopped by SIGTERM (to its ranks, as a scheduler does) after its first checkpoint, then
resumed with another number of processes or engine. It must end with the uninterrupted 2-process run's adapter
(rtol 1e-4), log the same loss at every step, and train every example exactly once per epoch — checked by the
example ids each rank records (GLMTUNE_EXAMPLE_LOG).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import BIN, REPO
from helpers.files import metrics_rows
from helpers.launch import ranks_env
from test_same_math import adapter, assert_same_adapter

from glmtune.models.presets import ensure_tiny
from glmtune.train.checkpoints import all_checkpoints, is_complete

pytestmark = pytest.mark.slow

STEPS, EXAMPLES, GLOBAL_BATCH = 14, 51, 4  # data/samples/train.jsonl: 13 steps an epoch, the 13th padded
ARGS = [
    "lora=all_linear",
    "lora.dropout=0",
    "train.learning_rate=5e-3",
    "train.logging_steps=1",
    f"train.max_steps={STEPS}",
    "train.save_steps=3",
    "probe.enabled=false",
    "data.val_file=null",
]


def launch(out: Path, nproc: int, *extra: str, log: Path) -> subprocess.Popen:
    env = ranks_env(GLMTUNE_EXAMPLE_LOG=str(log), PYTHONUNBUFFERED="1")
    log.mkdir(parents=True, exist_ok=True)
    launcher = (
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", "glmtune"]
        if nproc > 1
        else [sys.executable, "-m", "glmtune"]
    )
    return subprocess.Popen(
        [*launcher, *ARGS, *extra, f"hydra.run.dir={out}"],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def ranks_of(proc: subprocess.Popen, nproc: int) -> list[int]:
    if nproc == 1:
        return [proc.pid]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in children]


def stop_after_first_checkpoint(out: Path, nproc: int, *extra: str, log: Path) -> None:
    proc = launch(out, nproc, *extra, log=log)
    deadline = time.monotonic() + 600
    while not any(is_complete(c) for c in all_checkpoints(out / "checkpoints")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint in 10 minutes"
        time.sleep(0.05)
    for pid in ranks_of(proc, nproc):
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    state = json.loads((out / "run_state.json").read_text())
    assert state["status"] == "interrupted" and state["step"] < STEPS, (state, err[-3000:])


def finish(out: Path, nproc: int, *extra: str, log: Path) -> str:
    proc = launch(out, nproc, *extra, log=log)
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return stdout


def step_losses(out: Path, key: str = "loss") -> dict[int, float]:
    rows = metrics_rows(out)
    return {r["step"]: r[key] for r in rows if "loss" in r}


def trained_ids(log: Path) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for path in log.glob("examples.rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).extend(row["ids"])
    return {step: sorted(ids) for step, ids in steps.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ensure_tiny("glm4")
    root = tmp_path_factory.mktemp("elastic")
    out = root / "reference"
    finish(out, 2, "train.per_device_batch_size=1", "train.grad_accum=2", log=root / "reference-ids")
    return (
        out,
        step_losses(out),
        adapter(out),
        trained_ids(root / "reference-ids"),
    )


def test_fourteen_steps_agree_across_processes_and_zero3(reference, tmp_path):
    """The plan's memory levers never change the result (test_same_math.py), here across processes and engines."""
    ref_dir, ref_losses, ref_adapter, _ = reference
    assert len(ref_losses) == STEPS
    for name, nproc, split in [
        ("4x1x1", 1, ["train.per_device_batch_size=4", "train.grad_accum=1"]),
        ("2x1x2", 2, ["train.per_device_batch_size=2", "train.grad_accum=1"]),
        ("zero3-1x2x2", 2, ["train.per_device_batch_size=1", "train.grad_accum=2", "dist=zero3"]),
    ]:
        out = tmp_path / name
        finish(out, nproc, *split, log=tmp_path / f"{name}-ids")
        assert step_losses(out) == pytest.approx(ref_losses, rel=1e-5), name
        # the whole LoRA gradient's norm, every step
        assert step_losses(out, "grad_norm") == pytest.approx(step_losses(ref_dir, "grad_norm"), rel=1e-5), name
        assert_same_adapter(adapter(out), ref_adapter, name)


@pytest.mark.parametrize(
    "first,then",
    [
        ((2, ["train.per_device_batch_size=1", "train.grad_accum=2"]), (1, [])),
        ((1, ["train.per_device_batch_size=2", "train.grad_accum=2"]), (2, [])),
        ((2, ["dist=zero3", "train.per_device_batch_size=1", "train.grad_accum=2"]), (1, ["dist=ddp"])),
    ],
    ids=["2-to-1-process", "1-to-2-processes", "zero3-to-ddp"],
)
def test_a_stopped_run_resumes_on_other_hardware_to_the_same_adapter(reference, tmp_path, first, then):
    ref_dir, ref_losses, ref_adapter, ref_ids = reference
    out, log = tmp_path / "run", tmp_path / "ids"
    stop_after_first_checkpoint(out, first[0], *first[1], log=log)
    # The resuming command keeps the first launch's settings but its memory levers, as a user would re-type it.
    kept = [a for a in first[1] if not a.startswith(("train.per_device_batch_size", "train.grad_accum", "dist="))]
    stdout = finish(out, then[0], *kept, *then[1], log=log)
    assert "keeps the global batch of 4" in stdout

    assert step_losses(out) == pytest.approx(ref_losses, rel=1e-5)
    assert_same_adapter(adapter(out), ref_adapter)
    ids = trained_ids(log)
    assert ids == ref_ids  # the same examples in every step: none skipped, none repeated
    first_epoch = [i for step in range(1, 14) for i in ids[step]]
    assert sorted(first_epoch) == list(range(EXAMPLES))
    assert all(len(ids[step]) == GLOBAL_BATCH for step in range(1, 13))
    metrics = json.loads((out / "metrics.json").read_text())
    losses = list(step_losses(out).values())
    assert metrics["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=0.01)


def test_a_resume_that_changes_the_training_math_is_refused(reference, tmp_path):
    """Memory levers may change; the model, LoRA shape, data, length and global batch may not (exit 2)."""
    out, log = tmp_path / "run", tmp_path / "ids"
    stop_after_first_checkpoint(out, 1, "train.per_device_batch_size=2", "train.grad_accum=2", log=log)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    changed = subprocess.run(
        [sys.executable, "-m", "glmtune", *ARGS, "lora.r=16", f"hydra.run.dir={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "lora.r" in changed.stderr
    batch = subprocess.run(
        [
            sys.executable,
            "-m",
            "glmtune",
            *ARGS,
            "train.per_device_batch_size=3",
            "train.grad_accum=1",
            f"hydra.run.dir={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert batch.returncode == 2 and "Traceback" not in batch.stderr and "global batch" in batch.stderr
