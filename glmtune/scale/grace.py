"""terminationGracePeriodSeconds for a TrainJob's pods: how long they need between SIGTERM and their exit.

Kueue pre-empts a TrainJob by suspending it: every pod gets SIGTERM, and SIGKILL when the grace period runs out.
glmtune's ranks answer SIGTERM by finishing the optimizer step in flight, agreeing on it, writing one complete
checkpoint and exiting 7 (launch/signals.py, train/guard.py). A pod that exits sooner is deleted at once, so a
generous period costs a pre-emption nothing, while one too short kills the save (the resume then starts from the
checkpoint before, up to train.save_minutes of work lost). So each term is an upper bound:

- the step in flight: a whole optimizer step (micro-batch x accumulation rows per rank) of the frozen model's
  forward, its backward to the inputs (twice a forward) and, with checkpointing, the recompute, at MFU of the
  card's datasheet dense bf16 TFLOP/s (the H100 rows of bench/RESULTS.md §0 reach about twice that); ZeRO-3 adds
  its measured 1.64 s per micro-step, pinned checkpoint offload its measured 12 %;
- the save: the checkpoint's bytes (train/preflight.checkpoint_bytes) written, fsynced and read back for the
  marker's sha256 (train/checkpoints.py), at VOLUME_BYTES_S;
- the exit: TEARDOWN_S for the stop's agreement, the process group's and CUDA's teardown and torchrun's exit.

mode=plan runs no step and writes no checkpoint, so nothing here is measured on the cluster's cards and volume.
"""

from __future__ import annotations

import math

from ..config import RunConfig
from ..config.units import MIB
from ..plan.archsize import frozen_params
from ..plan.planner import Choices
from ..train.preflight import checkpoint_bytes

# Datasheet dense bf16 tensor TFLOP/s per conf/hw preset (fp16 for V100 and T4, which have no bf16).
TFLOPS = {
    "a100_40g": 312,
    "a100_80g": 312,
    "h100_80g": 989,
    "h200_141g": 989,
    "l40s_48g": 362,
    "a10_24g": 125,
    "rtx3090_24g": 71,
    "rtx4090_24g": 165,
    "v100_32g": 125,
    "t4_16g": 65,
}
UNKNOWN_TFLOPS = 1  # a card of your own preset, or a CPU run: slow on purpose (the period only has to be long enough)
MFU = 0.2
ZERO3_S_PER_MICRO_STEP = 1.64  # bench/RESULTS.md §0: ZeRO-3's parameter gathers on an H100, per micro-step
OFFLOAD_SLOWDOWN = 1 / 0.88  # pinned checkpoint offload, same rows
VOLUME_BYTES_S = 100 * MIB  # a network file system's sustained write; local NVMe is 10-30x faster
SAVE_PASSES = 3  # written, fsynced, read back for the COMPLETE marker's sha256
TEARDOWN_S = 60


def step_seconds(run: RunConfig, arch, c: Choices) -> float:
    """An upper bound on one optimizer step of one rank, in seconds."""
    tokens = c.micro_batch_size * c.grad_accum * c.max_length / c.sequence_parallel  # a rank's share of the rows
    # multiply-adds per token: every frozen weight, and attention's scores and values over the row (causal: half)
    forward = 2 * (frozen_params(arch) + arch.num_layers * c.max_length * arch.hidden_size)
    passes = 4 if c.gradient_checkpointing else 3  # forward, backward to the inputs (2x), the recompute
    seconds = tokens * forward * passes / (TFLOPS.get(run.hw.name, UNKNOWN_TFLOPS) * 1e12 * MFU)
    if c.offload_checkpoints:
        seconds *= OFFLOAD_SLOWDOWN
    if c.zero_stage == 3:
        seconds += ZERO3_S_PER_MICRO_STEP * c.grad_accum
    return seconds


def save_seconds(run: RunConfig, arch, c: Choices) -> float:
    return SAVE_PASSES * checkpoint_bytes(run, arch, c) / VOLUME_BYTES_S


def grace_seconds(run: RunConfig, arch, c: Choices) -> int:
    """terminationGracePeriodSeconds: the step in flight, one complete checkpoint and the processes' exit."""
    return math.ceil(step_seconds(run, arch, c) + save_seconds(run, arch, c) + TEARDOWN_S)
