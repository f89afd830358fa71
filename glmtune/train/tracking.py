"""One tracker run per launch (train.report_to), named like the run dir, holding glmtune's own settings.

The Trainer's integrations open their runs lazily and close them at the end of `train()`: MLflow's callback
then opened a second, unnamed run for the final evaluation, W&B and SwanLab kept theirs open into the next trial
of an in-process sweep, and none of them recorded glmtune's config (only the Trainer's arguments and the model's
config.json). So rank 0 opens each run here before training and closes it after the final evaluation: every
integration finds the run already active, logs into it, and leaves closing it to us.

Parameters: the validated config flattened (`lora.r`, `lora.target_modules`, `model.name`, `data.train_file`,
...), the plan's choices (`plan.micro_batch_size`, ...) with its estimate (`plan.peak_gib`, `plan.budget_gib`),
and the probe's measured peak (`probe.peak_gib`). TensorBoard's run is its folder (<run dir>/tensorboard); the
same parameters go to its HParams tab.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from ..config.units import GIB
from ..launch.exits import EXIT_CRASH, EXIT_INTERRUPTED

MLFLOW_STATUS = {"done": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def run_label(run_dir: Path) -> str:
    """The run dir as the user sees it: relative to the working directory when inside it
    (outputs/2026-11-26/07-36-04, multirun/.../3), else its last two parts."""
    path = Path(os.path.abspath(run_dir))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return "/".join(path.parts[-2:])


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Nested dicts and dataclasses to dotted keys; lists become comma-separated strings (every tracker takes
    str/int/float/bool values, none takes a list), None becomes "null" (as in the YAML)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    key = prefix.rstrip(".")
    if isinstance(value, (list, tuple)):
        return {key: ",".join(map(str, value))}
    if value is None:
        return {key: "null"}
    return {key: value if isinstance(value, (int, float, bool)) else str(value)}


def launch_params(
    run, choices, planned_bytes: int | None, budget_bytes: int | None, probe_bytes: int | None, run_dir: Path
) -> dict[str, object]:
    """Everything one launch decided: the config, the plan's choices and estimate, the probe's measurement."""
    params = flatten(run)
    params.update(flatten(choices.to_dict(), "plan."))
    for key, value in (
        ("plan.peak_gib", planned_bytes),
        ("plan.budget_gib", budget_bytes),
        ("probe.peak_gib", probe_bytes),
    ):
        if value:  # GiB, 4 decimals: a 9B plan reads 17.5123, a tiny one 0.0123
            params[key] = round(value / GIB, 4)
    params["run_dir"] = str(Path(os.path.abspath(run_dir)))
    return params


class TrackerRuns:
    """Opens one run in each tracker of `report_to` (rank 0 only; `active=False` elsewhere), closes them on exit
    with the launch's outcome. Used as `with TrackerRuns(...):` around training and the final evaluation."""

    def __init__(self, report_to: list[str], run_dir: Path, params: dict[str, object], active: bool = True):
        self.report_to = list(report_to) if active else []
        self.run_dir, self.params, self.name = run_dir, params, run_label(run_dir)
        self.opened: list[str] = []

    def __enter__(self) -> "TrackerRuns":
        for tracker in self.report_to:
            getattr(self, f"_open_{tracker}")()
            self.opened.append(tracker)
        return self

    def __exit__(self, kind, error, tb) -> None:
        from ..launch.signals import Interrupted
        from .guard import StoppedBySignal

        stops = (StoppedBySignal, Interrupted, KeyboardInterrupt)
        outcome = "done" if kind is None else "stopped" if issubclass(kind, stops) else "failed"
        for tracker in reversed(self.opened):
            getattr(self, f"_close_{tracker}")(outcome)
        self.opened.clear()

    # TensorBoard: the Trainer's callback owns the scalars; the parameters go to the HParams plugin ----------------
    def _open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # The HParams tab links parameters to these scalar tags, which the Trainer's callback writes.
        metrics = {"train/loss": math.nan, "eval/loss": math.nan}
        with SummaryWriter(log_dir=str(self.run_dir / "tensorboard")) as writer:
            for summary in hparams(self.params, metrics):
                writer.file_writer.add_summary(summary)

    def _close_tensorboard(self, outcome: str) -> None:
        pass  # the Trainer's callback closes its own writer at the end of train() and after the final evaluation

    # W&B: WANDB_MODE=offline keeps it on disk; WANDB_PROJECT picks the project (default glmtune) -----------------
    def _open_wandb(self) -> None:
        import wandb

        wandb.init(
            project=os.environ.get("WANDB_PROJECT", "glmtune"),
            name=self.name,
            config=self.params,
            reinit="finish_previous",
        )

    def _close_wandb(self, outcome: str) -> None:
        import wandb

        wandb.finish(exit_code={"done": 0, "stopped": EXIT_INTERRUPTED}.get(outcome, EXIT_CRASH))

    # MLflow: MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME / MLFLOW_RUN_ID are read by mlflow itself --------------
    def _open_mlflow(self) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        if mlflow.active_run() is not None:  # a run some earlier code left open in this process (a sweep's trial)
            mlflow.end_run()
        mlflow.start_run(run_name=self.name)
        # MLflow refuses a longer value (6,000 characters in MLflow 3, fewer before): a long path is cut, not fatal
        items = [(k, v[:MAX_PARAM_VAL_LENGTH] if isinstance(v, str) else v) for k, v in self.params.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    def _close_mlflow(self, outcome: str) -> None:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run(MLFLOW_STATUS[outcome])

    # SwanLab: SWANLAB_MODE=local (or offline) and SWANLAB_LOG_DIR keep it on disk --------------------------------
    def _open_swanlab(self) -> None:
        import swanlab

        swanlab.init(project="glmtune", name=self.name, config=self.params)

    def _close_swanlab(self, outcome: str) -> None:
        import swanlab

        swanlab.finish(state="success" if outcome == "done" else "crashed")
