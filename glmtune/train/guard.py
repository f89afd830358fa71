"""Per-step decisions every rank must agree on: stop on a signal (saving first), stop on divergence, and
save every train.save_minutes.

After each optimizer step each rank contributes four flags — a stop signal arrived, a micro-batch loss was
NaN/inf, an adapter weight is NaN/inf (an infinite gradient shows up there right after the step), the
save interval elapsed — and one all-reduce (MAX) of those four numbers makes every rank take the same
branch at the same step. Ranks that disagreed would deadlock: one entering the collective checkpoint save,
another the next forward pass. One 4-element all-reduce per step costs microseconds; a lone process skips it.

Divergence is checked on the weights after the optimizer step, before any save at that step, so no
checkpoint with NaN weights is ever marked complete. Under fp16 an infinite gradient is normal (the loss
scaler skips that step and lowers the scale) and leaves the weights finite, so it is not reported.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..launch.signals import STOP

__all__ = ["Diverged", "Guard", "StoppedBySignal"]


class Diverged(Exception):
    def __init__(self, step: int, what: str):
        super().__init__(f"step {step}: {what}")
        self.step, self.what = step, what


class StoppedBySignal(Exception):
    def __init__(self, step: int, name: str):
        super().__init__(f"{name} at step {step}")
        self.step, self.name = step, name


class Guard(TrainerCallback):
    def __init__(self, save_minutes: float, trainable: list[torch.nn.Parameter]):
        self.save_seconds = save_minutes * 60 if save_minutes > 0 else math.inf
        self.trainable = trainable
        self.losses_finite: torch.Tensor | None = None  # AND of this step's micro-batch losses (no sync)
        self.last_save = time.monotonic()
        self.diverged: Diverged | None = None
        self.stopped: StoppedBySignal | None = None

    def observe_loss(self, loss: torch.Tensor) -> None:
        ok = torch.isfinite(loss.detach()).all()
        self.losses_finite = ok if self.losses_finite is None else self.losses_finite & ok

    def on_train_begin(self, args, state, control, **kwargs):
        STOP.deferred = True  # from here a signal is recorded and answered with a save at the step's end
        self.last_save = time.monotonic()

    def on_save(self, args, state, control, **kwargs):
        self.last_save = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        loss_bad = self.losses_finite is not None and not bool(self.losses_finite)
        self.losses_finite = None
        weights_bad = not all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in self.trainable)
        due = time.monotonic() - self.last_save >= self.save_seconds
        signal_seen, loss_bad, weights_bad, due = _agree([STOP.received is not None, loss_bad, weights_bad, due])
        if loss_bad or weights_bad:
            what = "the loss is NaN/inf" if loss_bad else "an adapter weight became NaN/inf after the update"
            self.diverged = Diverged(state.global_step, what)
            control.should_save = False  # the last complete checkpoint is the last good one
            control.should_training_stop = True
        elif signal_seen:
            self.stopped = StoppedBySignal(state.global_step, STOP.received or "a stop signal on another rank")
            control.should_save = True
            control.should_training_stop = True
        elif due:
            control.should_save = True
        return control

    def raise_if_stopped(self) -> None:
        if self.diverged is not None:
            raise self.diverged
        if self.stopped is not None:
            raise self.stopped


def _agree(flags: list[bool]) -> list[bool]:
    """Each flag true on any rank becomes true on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flags
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def divergence_advice(lr: float, dtype: str, weight_decay: float = 0.0) -> str:
    # A tenth of the rate that diverged, but never above 1e-4: from a rate far too high (0.5) a tenth diverges too.
    advice = f"lower train.learning_rate (now {lr:g}), e.g. train.learning_rate={min(lr / 10, 1e-4):g}"
    if lr * weight_decay > 0.01:  # AdamW's decay alone shrinks every weight by over 1 % per step
        advice = (
            f"lower train.weight_decay (now {weight_decay:g}; usual values 0 to 0.1: it shrinks every weight "
            f"by lr x weight_decay = {lr * weight_decay:.2g} per step), or {advice}"
        )
    if dtype == "fp16":
        advice += "; fp16 overflows easily: train.precision=bf16 on Ampere or newer cards, else fp32"
    return advice


def describe_checkpoint(last: Path | None) -> str:
    return f"the last complete checkpoint is {last}" if last else "no checkpoint was saved before it"
