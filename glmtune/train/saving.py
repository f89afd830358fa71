"""Saving with the Trainer: the COMPLETE marker after every checkpoint, and the adapter as one unit.

See checkpoints.py for what "complete" means and why rotation is done here rather than by the Trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from ..rundir.atomic import folder_as_one_unit
from ..rundir.lock import read_state, write_state
from .checkpoints import mark_complete, rotate

log = logging.getLogger(__name__)


class CompleteMarker(TrainerCallback):
    """After each save: wait for every rank's files, fsync and mark the checkpoint (rank 0), record it in the
    run dir's run_state.json (a kill -9 leaves no chance to write it later), then rotate."""

    def __init__(self, output_dir: Path, keep: int, run_dir: Path | None = None):
        self.output_dir, self.keep, self.run_dir = output_dir, keep, run_dir
        self.last: Path | None = None

    def on_save(self, args, state, control, **kwargs):
        folder = self.output_dir / f"checkpoint-{state.global_step}"
        barrier()  # under ZeRO-3 each rank writes its own shard files into the folder
        if state.is_world_process_zero:
            mark_complete(folder, state.global_step)
            if self.run_dir is not None and read_state(self.run_dir) is not None:
                write_state(self.run_dir, step=state.global_step, checkpoint=str(folder))
            for old in rotate(self.output_dir, self.keep):
                log.info("removed old checkpoint %s (train.keep_checkpoints=%d)", old, self.keep)
        barrier()  # no rank resumes work believing in a marker rank 0 has not written yet
        self.last = folder


def save_adapter(trainer, final: Path) -> None:
    """The adapter's weights and adapter_config.json as one unit: rank 0 writes them into a temporary folder
    that replaces `final` whole, so no crash leaves new weights beside an old config (another lora.alpha
    would load without error at the wrong scale). Every rank calls it: under ZeRO-3 it is a collective."""
    if trainer.is_world_process_zero():
        with folder_as_one_unit(final) as tmp:
            trainer.save_model(str(tmp))
    else:
        trainer.save_model(str(final))  # gathers the shards; only rank 0 writes


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
