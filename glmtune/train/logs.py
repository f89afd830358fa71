"""What a run logs besides TensorBoard: metrics.jsonl, and the run's mean loss across resumes."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from ..rundir.atomic import append_line


class MetricsFile(TrainerCallback):
    """Every log line of the Trainer, one JSON object per line, in run_dir/metrics.jsonl (rank 0).

    The Trainer closes every launch with a train_runtime/train_loss line, also one that a signal or divergence
    stopped (`guard`, train/guard.py): that line gets "interrupted": true, since its loss and runtime are those
    of a launch cut short, not of the run (metrics.json has the run's)."""

    def __init__(self, path: Path, guard=None):
        self.path, self.guard = path, guard

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            row = {"step": state.global_step, **logs}
            if "train_runtime" in logs and self.guard is not None and (self.guard.stopped or self.guard.diverged):
                row["interrupted"] = True
            append_line(self.path, json.dumps(row))


def whole_run_loss(log_history: list[dict], launch_mean: float, steps: int, resumed_at: int) -> float:
    """The mean loss over every step of the run. The Trainer's own figure divides this launch's loss sum by all
    steps, resumed ones included; the steps before the resume are in the restored log history (each logged
    loss is the mean of the steps since the previous log), and this launch's unlogged tail is what its sum has
    beyond its logged part."""
    if not steps:
        return launch_mean
    total = launch_logged = 0.0
    previous = 0
    for entry in log_history:
        if "loss" in entry and "step" in entry:
            part = entry["loss"] * (entry["step"] - previous)
            total += part
            launch_logged += part if entry["step"] > resumed_at else 0.0
            previous = entry["step"]
    return (total + launch_mean * steps - launch_logged) / steps
