"""A resume on other hardware: the recorded global batch, re-split for this card and process count.

The first launch recorded its final choices (run_state.json). Its global batch G = micro-batch × accumulation
× processes is part of the training math and stays; everything else is a memory lever the new plan decides.
Per process G / W examples per step, as the largest micro-batch that divides them and is no larger than the
new plan's, the rest by accumulation. Checkpoints are portable between DDP world sizes and from ZeRO-3 to DDP
(train/portable.py); a ZeRO-3 engine loads only its own checkpoints at the same process count.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError
from .planner import Choices


def elastic_choices(recorded: Choices, planned: Choices, world: int, batch_set: bool) -> tuple[Choices, str]:
    """(the choices this launch trains with, one console line saying what changed); ConfigError when the
    recorded global batch cannot be kept or the checkpoint's engine cannot be loaded here.

    batch_set: the resuming command line set train.per_device_batch_size / grad_accum otherwise than the first
    launch; they are taken as they are when they keep the global batch, and refused when they do not."""
    global_batch = recorded.micro_batch_size * recorded.grad_accum * recorded.world_size
    asked = planned.micro_batch_size * planned.grad_accum * world
    if batch_set and asked != global_batch:
        raise ConfigError(
            f"micro-batch {planned.micro_batch_size} × accumulation {planned.grad_accum} × {world} "
            f"process{'es' if world > 1 else ''} is a global batch of {asked}, but the run trains "
            f"{global_batch} examples a step — set train.per_device_batch_size × train.grad_accum × "
            f"processes = {global_batch}, or leave them out and glmtune re-splits it for this card"
        )
    if global_batch % world:
        raise ConfigError(
            f"the run trains a global batch of {global_batch} examples, which {world} processes cannot "
            f"share evenly — resume with a number of processes that divides {global_batch}"
        )
    if recorded.zero_stage == 3 and planned.zero_stage == 3 and world != recorded.world_size:
        raise ConfigError(
            f"a ZeRO-3 checkpoint of {recorded.world_size} processes loads under ZeRO-3 only with "
            f"{recorded.world_size} — resume with that many processes, or with dist=ddp if a copy of "
            "the weights fits each card"
        )
    if recorded.zero_stage != 3 and planned.zero_stage == 3:
        raise ConfigError(
            "this card needs ZeRO-3, but the checkpoint is from plain data parallel, which ZeRO-3 "
            "cannot load in this version — resume on cards that hold the weights (dist=ddp), or "
            "start over with train.resume=restart"
        )
    per_process = global_batch // world
    micro = (
        planned.micro_batch_size
        if asked == global_batch
        else max(m for m in range(1, min(planned.micro_batch_size, per_process) + 1) if per_process % m == 0)
    )
    choices = replace(planned, micro_batch_size=micro, grad_accum=per_process // micro, world_size=world)
    changed = [
        f"on {world} data-parallel process{'es' if world > 1 else ''} instead of {recorded.world_size}"
        if world != recorded.world_size
        else "",
        f"with sequence parallelism {choices.sequence_parallel} instead of {recorded.sequence_parallel}"
        if choices.sequence_parallel != recorded.sequence_parallel
        else "",
        f"with micro-batch {micro} instead of {recorded.micro_batch_size}"
        if micro != recorded.micro_batch_size
        else "",
    ]
    where = ", ".join(c for c in changed if c) or "with the same split"
    engine = (
        ""
        if choices.zero_stage == recorded.zero_stage
        else f", {'ZeRO-3' if choices.zero_stage == 3 else 'data parallel'} instead of "
        f"{'ZeRO-3' if recorded.zero_stage == 3 else 'data parallel'}"
    )
    return choices, (
        f"resumed {where}{engine}: micro-batch {micro} × accumulation {per_process // micro} × "
        f"{world} keeps the global batch of {global_batch}"
    )
