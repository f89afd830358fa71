"""Run decisions: dtype, checkpointing, ZeRO stage, offload, micro-batch, accumulation, max length.

`Choices` is what the trainer applies. `make_plan` fills it from the memory estimator (estimate.py): it
starts from the fastest configuration and walks down `step_down`'s ladder (smaller micro-batch with
more accumulation, checkpointing, chunked loss, ZeRO-3, offload) until the estimate fits under
budget = hw.memory_gib x margin. Without a budget (no preset, no GPU) everything fits and the plan
still reports the estimate.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch

from ..config import RunConfig
from .advice import advise
from .estimate import GIB, RunShape, estimate, gpu_family, image_extra_tokens

DEFAULT_MAX_LENGTH = 500
LOSS_CHUNK = 1024  # tokens per chunk of the lower-memory loss: 1024 x 151,552 x 12 B = 1.9 GB peak
DEFAULT_EVAL_NEW_TOKENS = 512  # the GLM-4 demo's generation_config.max_new_tokens


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
class Plan:
    fits: bool
    budget_bytes: int | None
    peak_bytes: int
    breakdown: dict[str, int]
    choices: Choices
    reasons: dict[str, str]
    advice: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        keys = ("dtype", "gradient_checkpointing", "zero_stage", "offload_params", "offload_optimizer",
                "micro_batch_size", "grad_accum", "max_length", "world_size")
        return json.dumps({"fits": self.fits, "budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes,
                           "breakdown": self.breakdown, "choices": {k: getattr(self.choices, k) for k in keys},
                           "reasons": self.reasons, "advice": self.advice}, indent=2)


def local_dtype(run: RunConfig) -> tuple[str, str]:
    """bf16 where the device supports it, fp16 with loss scaling on GPUs without it, fp32 on CPU."""
    if run.train.precision != "auto":
        return run.train.precision, "set by train.precision"
    if run.hw.memory_gib is None and not torch.cuda.is_available():
        return "fp32", "no GPU: fp32 (bf16 autocast on CPU is slow and gains no memory that matters here)"
    if run.hw.bf16 and (run.hw.memory_gib is not None or torch.cuda.is_bf16_supported()):
        return "bf16", "the card supports bfloat16: half the memory of fp32, no loss scaling needed"
    return "fp16", "no bfloat16 on this card: fp16 with dynamic loss scaling"


def run_shape(run: RunConfig, arch, c: Choices, data_max_tokens: int | None = None) -> RunShape:
    seq = min(c.max_length, data_max_tokens) if data_max_tokens else c.max_length
    images = 1 if arch.vision_config else 0  # GLM-4V: one image per conversation, sized for the worst case
    on_gpu = run.hw.memory_gib is not None or torch.cuda.is_available()
    return RunShape(dtype=c.dtype, micro_batch=c.micro_batch_size, seq_len=seq + image_extra_tokens(arch) * images,
                    lora_r=run.lora.r, lora_targets=tuple(run.lora.target_modules), lora_dropout=run.lora.dropout,
                    gradient_checkpointing=c.gradient_checkpointing, loss_chunk_tokens=c.loss_chunk_tokens,
                    zero_stage=c.zero_stage, offload_params=c.offload_params, offload_optimizer=c.offload_optimizer,
                    world_size=c.world_size, images_per_sample=images,
                    eval_batch=c.eval_batch_size if run.data.val_file else 0,
                    eval_max_new_tokens=0, device="cuda" if on_gpu else "cpu", gpu_family=gpu_family(run.hw.name))


def step_down(plan_or_choices: Plan | Choices, run: RunConfig, arch, world_size: int) -> Choices | None:
    """The next, slower but smaller configuration, or None when the ladder is exhausted.

    Rungs in order: halve the micro-batch (doubling accumulation, same global batch); checkpointing on
    (unless forced off); chunked loss; ZeRO-3 (world_size > 1, unless dist.strategy=ddp); param and
    optimizer offload (ZeRO-3, last resort: every step copies all weights over PCIe)."""
    c = plan_or_choices.choices if isinstance(plan_or_choices, Plan) else plan_or_choices
    if c.micro_batch_size > 1:
        return replace(c, micro_batch_size=c.micro_batch_size // 2, grad_accum=c.grad_accum * 2)
    if not c.gradient_checkpointing and run.train.gradient_checkpointing != "off":
        return replace(c, gradient_checkpointing=True)
    if c.loss_chunk_tokens == 0:
        return replace(c, loss_chunk_tokens=LOSS_CHUNK)
    if c.zero_stage == 0 and world_size > 1 and run.dist.strategy != "ddp":
        return replace(c, zero_stage=3)
    if not c.offload_params and run.dist.strategy != "ddp":
        return replace(c, zero_stage=3, offload_params=True, offload_optimizer=True)
    return None


def _budget(run: RunConfig, margin: float) -> int | None:
    if run.hw.memory_gib is not None:
        return int(run.hw.memory_gib * GIB * margin)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory * margin)
    return None


def make_plan(run: RunConfig, arch, world_size: int, user_set_max_length: bool,
              data_max_tokens: int | None = None, margin: float | None = None, advice: bool = True) -> Plan:
    budget = _budget(run, run.hw.margin if margin is None else margin)
    dtype, why_dtype = local_dtype(run)
    max_length = run.data.max_length if user_set_max_length else DEFAULT_MAX_LENGTH
    c = Choices(dtype=dtype, gradient_checkpointing=run.train.gradient_checkpointing == "on",
                zero_stage=3 if run.dist.strategy == "zero3" else 0, offload_params=False, offload_optimizer=False,
                micro_batch_size=run.train.per_device_batch_size, grad_accum=run.train.grad_accum,
                max_length=max_length, world_size=world_size, eval_batch_size=run.train.eval_batch_size)
    reasons = {"dtype": why_dtype,
               "max_length": "set by data.max_length" if user_set_max_length else
               f"default {DEFAULT_MAX_LENGTH} tokens (data.max_length not set)"}

    def peak(ch: Choices):
        return estimate(arch, run_shape(run, arch, ch, data_max_tokens))

    def fits(ch: Choices) -> bool:
        return budget is None or peak(ch).peak_bytes <= budget

    # Frozen weights alone exceed one card: only ZeRO-3 over several GPUs shards them.
    weights_only = peak(c).breakdown.get("frozen weights", 0)
    if (budget is not None and weights_only > budget and world_size > 1 and run.dist.strategy == "auto"):
        c = replace(c, zero_stage=3)
    start = c
    while not fits(c):
        nxt = step_down(c, run, arch, world_size)
        if nxt is None:
            break
        c = nxt
    # Evaluation batch: halve until the eval forward fits too.
    while c.eval_batch_size > 1 and not fits(c):
        c = replace(c, eval_batch_size=c.eval_batch_size // 2)
    est = peak(c)
    ok = budget is None or est.peak_bytes <= budget
    reasons.update(_reasons(run, start, c, budget, weights_only, world_size))
    plan = Plan(ok, budget, est.peak_bytes, est.breakdown, c, reasons)
    if not ok and advice:
        plan.advice = _advice(run, arch, world_size, c.max_length, data_max_tokens, margin)
    return plan


def _reasons(run, start: Choices, c: Choices, budget, weights: int, world_size: int) -> dict[str, str]:
    gib = (lambda x: f"{x / GIB:.1f} GiB")
    r = {}
    r["gradient_checkpointing"] = (f"train.gradient_checkpointing={run.train.gradient_checkpointing}"
                                   if run.train.gradient_checkpointing != "auto" else
                                   "on: activations of every block do not fit" if c.gradient_checkpointing else
                                   "off: activations fit, no recompute cost")
    if run.dist.strategy != "auto":
        r["zero_stage"] = f"dist.strategy={run.dist.strategy}"
    elif c.zero_stage == 3 and budget is not None and weights > budget:
        r["zero_stage"] = f"3: frozen weights {gib(weights)} exceed the {gib(budget)} budget; sharded over {world_size} GPUs"
    else:
        r["zero_stage"] = "3: needed to fit" if c.zero_stage == 3 else "0: plain data parallel fits (ZeRO-1/2 shard nothing useful for LoRA)"
    r["loss_chunk_tokens"] = (f"{c.loss_chunk_tokens}: the full fp32 logits do not fit" if c.loss_chunk_tokens
                              else "0: reference loss fits")
    r["offload_params"] = "on: last resort, nothing else fits (slow: weights cross PCIe every step)" \
        if c.offload_params else "off"
    r["micro_batch_size"] = (f"{c.micro_batch_size} x grad_accum {c.grad_accum} x {world_size} GPUs keeps the "
                             f"global batch {start.micro_batch_size * start.grad_accum * world_size}")
    r["eval_batch_size"] = ("halved until evaluation fits" if c.eval_batch_size < start.eval_batch_size
                            else "train.eval_batch_size")
    return r


def _advice(run, arch, world_size: int, max_length: int, data_max_tokens, margin) -> list[str]:
    """The overrides that would fit, each one planned again (plan/advice.py); empty when none does."""
    def replan(changed: RunConfig, world: int) -> Plan:
        return make_plan(changed, arch, world, True, data_max_tokens, margin, advice=False)

    return advise(run, world_size, max_length, replan)


def format_plan(plan: Plan):
    """Rich table: breakdown in GiB, then each decision with its reason."""
    from rich.table import Table

    table = Table(title=f"memory plan: {'fits' if plan.fits else 'DOES NOT FIT'}", show_header=True)
    table.add_column("item")
    table.add_column("value", justify="right")
    for name, value in plan.breakdown.items():
        table.add_row(name, f"{value / GIB:.2f} GiB")
    table.add_row("[bold]estimated peak", f"[bold]{plan.peak_bytes / GIB:.2f} GiB")
    budget = "none (no GPU)" if plan.budget_bytes is None else f"{plan.budget_bytes / GIB:.2f} GiB"
    table.add_row("[bold]budget", budget)
    for key, value in plan.choices.to_dict().items():
        table.add_row(key, f"{value}  [dim]{plan.reasons.get(key, '')}")
    for line in plan.advice:
        table.add_row("[red]advice", line)
    return table
