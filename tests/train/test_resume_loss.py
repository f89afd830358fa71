"""The train loss of a run stopped between two logging steps and resumed equals the uninterrupted run's.

The stop is a real SIGTERM that the run sends itself at the end of a chosen optimizer step (from the guard's
step-end hook, before the guard reads the signal flag), so the stop step is exact; the rest is the command line
in this process (helpers/cli.py glmtune_in_process): the guard's save, exit 7, and the same command resuming.
"""

import json
import os
import signal

import pytest
from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.files import metrics_rows

STEPS, LOG_EVERY, STOP_AT = 24, 5, 17  # 17: two steps after the log at 15, three before the one at 20
ARGS = [
    "lora=all_linear",
    "train.learning_rate=1e-2",
    f"train.max_steps={STEPS}",
    f"train.logging_steps={LOG_EVERY}",
    "probe.enabled=false",
    f"data.train_file={REPO / 'data/samples/train.jsonl'}",
    "data.val_file=null",
]


def sigterm_at_step(monkeypatch, step: int) -> None:
    """SIGTERM to this process at the end of optimizer step `step`, before the guard reads the signal flag."""
    from glmtune.train.guard import Guard

    original = Guard.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == step:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler only records it (deferred): no traceback here
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(Guard, "on_step_end", on_step_end)


@pytest.mark.slow  # three tiny trainings of 24 steps (~50 s of CPU), one stopped by a signal
def test_train_loss_after_a_stop_between_logging_steps_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    reference = glmtune_in_process(*ARGS, f"hydra.run.dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    sigterm_at_step(monkeypatch, STOP_AT)
    stopped = glmtune_in_process(*ARGS, f"hydra.run.dir={run_dir}")
    monkeypatch.undo()
    assert stopped.returncode == 7, stopped.stderr[-3000:]
    assert f"stopped by SIGTERM at step {STOP_AT}:" in stopped.stderr
    closing = [r for r in metrics_rows(run_dir) if "train_runtime" in r]
    assert len(closing) == 1 and closing[0].get("interrupted") is True  # the cut-short launch's figures, marked

    resumed = glmtune_in_process(*ARGS, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'checkpoint-{STOP_AT}'}" in resumed.stdout

    ref = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    got = json.loads((run_dir / "metrics.json").read_text())
    assert got["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-4)
    # The Trainer's own figures too: the loss logged at step 20 is the mean over steps 16-20, and the resumed
    # launch's closing line (not marked) carries the whole run's train_loss.
    logged = {r["step"]: r["loss"] for r in metrics_rows(run_dir) if "loss" in r}
    assert logged == {r["step"]: r["loss"] for r in metrics_rows(tmp_path / "reference") if "loss" in r}
    final = [r for r in metrics_rows(run_dir) if "train_runtime" in r and not r.get("interrupted")]
    assert len(final) == 1 and final[0]["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-4)
    state = json.loads((run_dir / "checkpoints" / f"checkpoint-{STOP_AT}" / "loss_state.json").read_text())
    assert state["step"] == STOP_AT and state["last_logged_step"] == 15 and len(state["unlogged_loss_sums"]) == 1
