"""Run decisions: dtype, checkpointing, ZeRO stage, offload, micro-batch, accumulation, max length.

`Choices` is what the trainer applies. The memory planner fills it from the estimator; until a budget is
known it falls back to `default_choices`, which applies the user's settings and resolves the `auto`s from
the local device.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .config import RunConfig


@dataclass
class Choices:
    dtype: str  # bf16 | fp16 | fp32: compute dtype and dtype of the frozen weights
    gradient_checkpointing: bool
    zero_stage: int  # 0 (plain data parallel) or 3 (DeepSpeed ZeRO-3)
    offload_params: bool
    offload_optimizer: bool
    micro_batch_size: int
    grad_accum: int
    max_length: int
    world_size: int
    eval_batch_size: int
    loss_chunk_tokens: int = 0  # 0 = reference loss; >0 = chunked loss, fp32 logits for this many tokens at a time

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Decisions:
    choices: Choices
    reasons: dict[str, str] = field(default_factory=dict)


def local_dtype(run: RunConfig) -> tuple[str, str]:
    """bf16 where the device supports it, fp16 with loss scaling on GPUs without it, fp32 on CPU."""
    if run.train.precision != "auto":
        return run.train.precision, "set by train.precision"
    if not torch.cuda.is_available():
        return "fp32", "no GPU: fp32 (bf16 autocast on CPU is slow and gains no memory that matters here)"
    if run.hw.bf16 and torch.cuda.is_bf16_supported():
        return "bf16", "the card supports bfloat16: half the memory of fp32, no loss scaling needed"
    return "fp16", "no bfloat16 on this card: fp16 with dynamic loss scaling"


def default_choices(run: RunConfig, world_size: int) -> Decisions:
    dtype, why_dtype = local_dtype(run)
    ckpt = run.train.gradient_checkpointing == "on"
    zero = 3 if run.dist.strategy == "zero3" else 0
    choices = Choices(dtype=dtype, gradient_checkpointing=ckpt, zero_stage=zero, offload_params=False,
                      offload_optimizer=False, micro_batch_size=run.train.per_device_batch_size,
                      grad_accum=run.train.grad_accum, max_length=run.data.max_length, world_size=world_size,
                      eval_batch_size=run.train.eval_batch_size)
    return Decisions(choices, {"dtype": why_dtype,
                               "gradient_checkpointing": f"train.gradient_checkpointing={run.train.gradient_checkpointing}",
                               "zero_stage": f"dist.strategy={run.dist.strategy}"})
