"""The Trainer's progress bar with glmtune's own lines: `step 5: loss 7.4731, lr 4.5e-04, epoch 0.10, 1,234 tokens/s,
peak GPU 17.80 GiB` instead of the Python dict the Trainer writes under it, and no dict of
train_runtime/samples_per_second at the end (the closing line and metrics.json carry those). Every value is also in
metrics.jsonl and the trackers.

Throughput is over the training steps since the previous line only (the time between a step's start and end:
evaluations and checkpoint saves in between are not counted against it), in input tokens of all ranks, padding
included, as the closing line counts them. Memory is the logging interval's measured peak (train/timeline.py): the
whole GPU process as the plan predicts it, or on CPU the process's peak resident set.

In a log (stderr not a terminal: a file, CI, SLURM's output) the bars print every update on one line with
carriage returns; there the evaluation bar is not nested under the training bar (its cursor-up moves mean
nothing in a file) and each of glmtune's lines starts a line of its own instead of following a bar's last update
(`...| 2/2 [00:00<00:00]step 2: eval loss 7.5` in `cmd > log 2>&1`).
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback
from transformers.trainer_utils import has_length

_SHORT = {"learning_rate": "lr", "grad_norm": "grad norm"}
# Carried on the log for metrics.jsonl and the trackers, not for a person: the running token count (the line shows
# the rate), a closing record's totals, the memory figures (the line shows the step peak as `peak ...`).
_HIDDEN = ("total_flos", "num_input_tokens_seen")


def step_line(
    step: int, logs: dict, tokens_per_s: float | None = None, peak_gib: float | None = None, on_gpu: bool = False
) -> str:
    parts = []
    for key, value in logs.items():
        if "runtime" in key or key.endswith("per_second") or key in _HIDDEN or key.startswith("memory/"):
            continue  # timings of one evaluation: in metrics.jsonl
        name = _SHORT.get(key, key.replace("eval_", "eval "))
        if isinstance(value, float):
            text = (
                f"{value:.2e}"
                if key == "learning_rate"
                else f"{value:.2f}"
                if key == "epoch"
                else f"{value:.4f}"
                if key.endswith("loss")
                else f"{value:.4g}"
            )
        else:
            text = str(value)
        parts.append(f"{name} {text}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tokens/s")
    if peak_gib is not None:
        parts.append(f"peak {'GPU' if on_gpu else 'RSS'} {peak_gib:.2f} GiB")
    return f"step {step}: " + ", ".join(parts)


class BarStream:
    """stderr as the bars write to it, remembering whether their last write left a line open (no newline yet)."""

    def __init__(self, stream):
        self.stream, self.open, self.muted = stream, False, False

    def write(self, text: str) -> int:
        if self.muted:
            return 0
        if text:
            self.open = not text.endswith("\n")
        return self.stream.write(text)

    def end_line(self) -> None:
        """A newline after a bar's last update, so that what is printed next starts a line."""
        if self.open:
            self.write("\n")
            self.stream.flush()

    def __getattr__(self, name):  # flush, encoding, fileno: the stream's own
        return getattr(self.stream, name)


class StepLines(ProgressCallback):
    def __init__(self, stream=None):
        super().__init__()
        self.on_gpu = torch.cuda.is_available()
        self.step_started: float | None = None
        self.busy_s = 0.0  # seconds inside training steps since the last training line
        self.tokens = 0  # state.num_input_tokens_seen at the last training line
        stream = stream or sys.stderr
        self.log = None if stream.isatty() else BarStream(stream)  # a log file: its bars and lines kept apart

    def on_train_begin(self, args, state, control, **kwargs):
        if self.log is None:
            super().on_train_begin(args, state, control, **kwargs)
        else:  # ProgressCallback's own bar, writing through self.log
            if state.is_world_process_zero:
                self.training_bar = tqdm(total=state.max_steps, dynamic_ncols=True, file=self.log)
            self.current_step = 0
        self.busy_s, self.tokens = 0.0, state.num_input_tokens_seen  # a resume starts from the checkpoint's count

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if (
            self.log is not None
            and state.is_world_process_zero
            and self.prediction_bar is None
            and has_length(eval_dataloader)
        ):
            # In a log, not nested: on a line of its own after the training bar's, at position 0 (no cursor moves)
            self.log.end_line()
            self.prediction_bar = tqdm(
                total=len(eval_dataloader), leave=False, position=0, dynamic_ncols=True, file=self.log
            )
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_prediction_bar(super().on_evaluate, args, state, control, **kwargs)

    def on_predict(self, args, state, control, **kwargs):
        self._close_prediction_bar(super().on_predict, args, state, control, **kwargs)

    def _close_prediction_bar(self, close, args, state, control, **kwargs):
        """In a log the bar's last update stays as written: clearing it (leave=False) would add a line of spaces."""
        if self.log is not None:
            self.log.muted = True
        try:
            close(args, state, control, **kwargs)
        finally:
            if self.log is not None:
                self.log.muted = False

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self.step_started is not None:
            self.busy_s += time.perf_counter() - self.step_started
            self.step_started = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        rate = None
        if "loss" in logs:  # a training line: the rate of the steps since the previous one
            seen = state.num_input_tokens_seen
            rate = (seen - self.tokens) / self.busy_s if self.busy_s > 0 and seen > self.tokens else None
            self.busy_s, self.tokens = 0.0, seen
        line = step_line(state.global_step, logs, rate, logs.get("memory/step_peak_gib"), self.on_gpu)
        if self.log is not None:  # a log: the bars' open line ended, then the line (tqdm.write would clear the bars
            self.log.end_line()  # with carriage returns on that same line, which a file keeps)
            print(line, flush=True)
        elif self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)
