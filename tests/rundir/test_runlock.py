"""Run-dir decisions, the lock, atomic writes and complete-marked checkpoints, in-process (fast)."""

import json
import os

import pytest

from glmtune.config import ConfigError
from glmtune.rundir.atomic import folder_as_one_unit, write_text
from glmtune.rundir.lock import RunDirLock, decide, trim_metrics, write_state
from glmtune.train.checkpoints import last_complete, mark_complete, remove_incomplete, rotate

CONFIG = {"train": {"learning_rate": 5e-4, "max_steps": 40, "resume": "auto"}, "lora": {"r": 8}}


def checkpoint(run_dir, step, complete=True):
    folder = run_dir / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    if complete:
        mark_complete(folder, step)
    return folder


def test_only_marked_checkpoints_count_and_rotation_keeps_the_newest(tmp_path):
    out = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    checkpoint(tmp_path, 8, complete=False)  # a save that was killed
    assert last_complete(out) == out / "checkpoint-6"
    assert remove_incomplete(out) == [out / "checkpoint-8"] and not (out / "checkpoint-8").exists()
    assert rotate(out, keep=2) == [out / "checkpoint-2"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    (out / "checkpoint-6" / "COMPLETE").write_text('{"step": 4}')  # a marker copied from elsewhere
    assert last_complete(out) == out / "checkpoint-4"


def test_fresh_dir_starts_and_an_interrupted_run_resumes_with_its_choices(tmp_path):
    (tmp_path / "rank0.log").write_text("this launch's log\n")
    assert decide(tmp_path, "auto", CONFIG, None, leader=True).resume_from is None
    write_state(tmp_path, status="interrupted", mode="train", config=CONFIG, choices={"micro_batch_size": 2})
    last = checkpoint(tmp_path, 4)
    start = decide(tmp_path, "auto", {**CONFIG, "train": {**CONFIG["train"], "max_steps": 80}}, last, leader=True)
    assert start.resume_from == last and start.choices == {"micro_batch_size": 2}


@pytest.mark.parametrize(
    "status,mode,config,fragment",
    [
        ("done", "auto", CONFIG, "holds a finished run"),
        ("diverged", "auto", CONFIG, "holds a diverged run"),
        ("interrupted", "auto", {**CONFIG, "lora": {"r": 16}}, "another config (lora.r: 8 -> 16)"),
    ],
)
def test_refusals_name_the_way_out(tmp_path, status, mode, config, fragment):
    write_state(tmp_path, status=status, mode="train", config=CONFIG)
    last = checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match="train.resume=restart") as err:
        decide(tmp_path, mode, config, last, leader=True)
    assert fragment in str(err.value)
    assert decide(tmp_path, mode, config, last, leader=False).resume_from is None  # only the leader refuses


def test_restart_moves_everything_aside_and_always_continues_a_finished_run(tmp_path):
    write_state(tmp_path, status="done", mode="train", config=CONFIG)
    last = checkpoint(tmp_path, 4)
    assert decide(tmp_path, "always", CONFIG, last, leader=True).resume_from == last
    start = decide(tmp_path, "restart", CONFIG, last, leader=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("replaced-")]
    assert start.resume_from is None and len(aside) == 1
    assert {p.name for p in aside[0].iterdir()} == {"run_state.json", "checkpoints"}


def test_files_that_are_not_a_run_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a glmtune run"):
        decide(tmp_path, "auto", CONFIG, None, leader=True)


def test_a_second_lock_on_the_same_dir_is_refused_until_released(tmp_path):
    first = RunDirLock(tmp_path, 0).acquire()
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()}"):
        RunDirLock(tmp_path, 0).acquire()
    first.release()
    RunDirLock(tmp_path, 0).acquire().release()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_text(tmp_path / "plan.json", "old\n")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), folder_as_one_unit(tmp_path / "adapter") as tmp:
        (tmp / "adapter_model.safetensors").write_bytes(b"new weights")
        raise Boom  # a crash before the config is written: nothing of it becomes "adapter"
    assert not (tmp_path / "adapter").exists()
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_trim_metrics_drops_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    trim_metrics(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
