"""Checks between the plan and the first allocation: the device can run the dtype, the host has the RAM a
CPU run needs, the disk has room for the checkpoints. Each failure is one line, before anything is loaded.

Light on purpose (no transformers import): it runs before the Trainer stack is imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..config.units import GIB, MIB
from ..plan.estimate import lora_params
from ..plan.host import HOST_MARGIN, available_ram
from ..plan.planner import Choices, Plan, run_shape


def check_device(choices: Choices) -> None:
    """fp16 training needs CUDA (the Trainer's GradScaler and autocast have no CPU fp16 path)."""
    if choices.dtype == "fp16" and not torch.cuda.is_available():
        raise ConfigError(
            "train.precision=fp16 (or a card preset without bf16) needs a CUDA GPU, and this process "
            "sees none — use train.precision=fp32 (or bf16) on CPU, or run on the GPU machine"
        )


def check_host_memory(run: RunConfig, plan: Plan) -> None:
    """A CPU-only run has no card budget, so the plan "fits" any micro-batch; the host's RAM is the budget.
    Refused here (exit 3, like a plan that does not fit a card) instead of swapping until the kernel kills it."""
    if torch.cuda.is_available() or run.hw.memory_gib is not None:
        return
    ram = available_ram()
    if ram is not None and plan.peak_bytes > ram * HOST_MARGIN:
        # The levers the user set above the micro-batch's own size come first: they are the likely cause.
        levers = (
            [f"data.pack_length (rows of {run.data.pack_length} tokens)"]
            if (run.data.pack_length and run.data.packing != "off")
            else []
        )
        if run.data.val_file and run.train.eval_batch_size > run.train.per_device_batch_size:
            levers.append(f"train.eval_batch_size (now {run.train.eval_batch_size})")
        largest = max(plan.breakdown, key=plan.breakdown.get) if plan.breakdown else None
        raise MemoryError(
            f"the plan estimates {plan.peak_bytes / GIB:.1f} GiB for micro-batch "
            f"{plan.choices.micro_batch_size} x {plan.choices.max_length} tokens"
            f"{f' (largest: {largest})' if largest else ''}, and this CPU-only machine has "
            f"{ram / GIB:.1f} GiB available — lower {', '.join(levers + [''])}"
            "train.per_device_batch_size (raise train.grad_accum to keep the global batch) or "
            "data.max_length"
        )


def checkpoint_bytes(run: RunConfig, arch, choices: Choices) -> int:
    """One checkpoint on disk: the adapter (fp32) plus its two Adam moments (fp32 each), plus under ZeRO-3
    DeepSpeed's fp32 master copy; the RNG/scheduler/trainer-state files are kilobytes."""
    params = lora_params(arch, run_shape(run, arch, choices))
    per_param = 4 + 8 + (4 if choices.zero_stage == 3 else 0)
    return params * per_param + MIB


def check_disk(run_dir: Path, run: RunConfig, arch, choices: Choices) -> str:
    """Room for keep_checkpoints + 1 checkpoints (the next is written before the oldest goes) and the adapter.
    Returns the line the console prints beside the plan."""
    each = checkpoint_bytes(run, arch, choices)
    needed = each * (run.train.keep_checkpoints + 1) + each // 3
    free = shutil.disk_usage(run_dir).free
    cadence = " and ".join(
        x
        for x in (
            f"every {run.train.save_steps} steps" if run.train.save_steps else "",
            f"every {run.train.save_minutes:g} min" if run.train.save_minutes else "",
        )
        if x
    )
    line = (
        f"checkpoints: {cadence or 'on a stop signal only'}, keep {run.train.keep_checkpoints}, "
        f"~{each / MIB:.1f} MiB each; {free / GIB:.1f} GiB free in {run_dir}"
    )
    if free < needed:
        raise ConfigError(
            f"{run_dir}: {free / MIB:.0f} MiB free, but {run.train.keep_checkpoints + 1} checkpoints "
            f"of ~{each / MIB:.0f} MiB and the adapter need ~{needed / MIB:.0f} MiB — free disk space, "
            "lower train.keep_checkpoints, or put hydra.run.dir on a larger disk"
        )
    return line
