"""The Trainer's running train loss, kept in every checkpoint, so a resumed run's train_loss is the whole run's.

transformers 4.40 keeps two sums: the losses of the intervals already logged (`Trainer._total_loss_scalar`, the
same on every rank) and, per rank, the losses since the last log (`tr_loss`, a tensor local to its training
loop); at the end train_loss = (logged + unlogged) / global_step. A resume started both at 0. Rebuilding the
logged part from the restored log history (what glmtune did) still lost the steps between the last log and the
stop, and a signal rarely lands on a logging step: 7.0875 against 7.4624 for a stop at step 17 with
logging_steps=5. So each checkpoint gets `loss_state.json` (rank 0, written atomically before the COMPLETE
marker): the logged sum, the step of that last log, and every rank's unlogged sum. A resume puts each back where
the loop keeps it, so the next logged loss (the mean since the last log) and train_loss equal an uninterrupted
run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..rundir.atomic import write_json

FILE = "loss_state.json"


class LossCarry:
    """One per Trainer: `tr_loss` is seen before every log/save decision (LoraTrainer._maybe_log_save_evaluate),
    saved with each checkpoint, and a resumed run's sums are put back at its first optimizer step."""

    def __init__(self):
        self.tr_loss: torch.Tensor | None = None
        self.pending: dict | None = None  # read from the checkpoint, not yet put back
        self.resumed = self.carried = False

    def restore(self, checkpoint: Path, step: int) -> bool:
        """Read the checkpoint's sums (before Trainer.train). False for a checkpoint without them (an older
        glmtune): train_loss then falls back to logs.whole_run_loss."""
        self.resumed = True
        try:
            state = json.loads((checkpoint / FILE).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(state, dict) or state.get("step") != step:
            return False
        self.pending = state
        return True

    def see(self, trainer, tr_loss: torch.Tensor) -> None:
        """Every optimizer step, before the Trainer decides to log or save. At the first one after a resume the
        sums go back: the logged sum and its step into the Trainer, this rank's unlogged sum into `tr_loss`
        (the mean of the old ranks' when the number of ranks changed)."""
        self.tr_loss = tr_loss
        if self.pending is None:
            return
        state, self.pending = self.pending, None
        trainer._total_loss_scalar = float(state["logged_loss_sum"])
        trainer._globalstep_last_logged = int(state["last_logged_step"])
        tails = [float(t) for t in state["unlogged_loss_sums"]]
        rank, world = trainer.args.process_index, trainer.args.world_size
        tr_loss += tails[rank] if len(tails) == world else sum(tails) / len(tails)
        self.carried = True

    def save(self, trainer, folder: Path) -> None:
        """Every rank calls it (its unlogged sum is gathered); rank 0 writes the file."""
        if self.tr_loss is None:
            return
        tails = trainer._nested_gather(self.tr_loss.detach().clone()).reshape(-1).tolist()
        if trainer.is_world_process_zero():
            write_json(
                folder / FILE,
                {
                    "step": trainer.state.global_step,
                    "logged_loss_sum": trainer._total_loss_scalar,
                    "last_logged_step": trainer._globalstep_last_logged,
                    "unlogged_loss_sums": tails,
                },
            )

    def train_loss(self, launch_loss: float, steps: int) -> float | None:
        """The run's mean train loss given the Trainer's figure for this launch; None when a resume had no sums
        to carry (an older checkpoint)."""
        if not self.resumed or self.carried:
            return launch_loss
        if self.pending is not None and steps:  # resumed at the last step: no step ran to put the sums back
            tails = [float(t) for t in self.pending["unlogged_loss_sums"]]
            return (float(self.pending["logged_loss_sum"]) + sum(tails) / len(tails)) / steps
        return None
