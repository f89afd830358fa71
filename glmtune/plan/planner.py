"""Run decisions: dtype, checkpointing, ZeRO stage, offload, micro-batch, accumulation, max length.

`Choices` (choices.py) is what the trainer applies. `make_plan` fills it from the memory estimator (estimate.py): it
starts from the fastest configuration and walks down `step_down`'s ladder (smaller micro-batch with
more accumulation, chunked loss, checkpointing, checkpoint offload, ZeRO-3) until the estimate fits under
budget = hw.memory_gib x margin. Without a budget (no preset, no GPU) everything fits and the plan
still reports the estimate.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import ConfigError, RunConfig, userds
from ..config.units import GIB
from . import longctx, sequence
from .advice import advise
from .choices import Choices, Plan, packing_figures, run_shape
from .estimate import estimate
from .host import host_figures, host_reason
from .packrows import path_reason
from .provenance import derived_near_budget, term_sources
from .quantized import allows_zero3
from .reasons import decision_reasons
from .tiledmlp import tile_tokens

DEFAULT_MAX_LENGTH = 500
LOSS_CHUNK = 1024  # tokens per chunk of the lower-memory loss: 1024 x 151,552 x 12 B = 1.9 GB peak
LOSS_CHUNK_SMALL = 256  # the next rung: 0.47 GB; the head matmul per chunk is still 256 x 4096 x 151,552


def plan_world(run: RunConfig, processes: int) -> int:
    """The processes a plan is for: dist.nnodes x dist.nproc_per_node for mode=plan and for a rehearsal, else the
    `processes` of the launch."""
    if run.mode == "plan":
        return run.dist.nnodes * run.dist.nproc_per_node
    return rehearsed_world(run, processes) or processes


def rehearsed_world(run: RunConfig, processes: int) -> int:
    """The ranks mode=probe rehearses in this process (probe/rehearse.py: rank 0 of them on this one device), or 0
    for a real probe of the `processes` running (and for every other mode)."""
    setting, planned = run.probe.rehearse, run.dist.nnodes * run.dist.nproc_per_node
    if setting is False or run.mode != "probe":
        return 0
    if processes > 1:
        if setting is True:
            raise ConfigError(
                f"probe.rehearse=true rehearses a plan in one process, and this launch has {processes}: "
                "run mode=probe without torchrun (dist.nproc_per_node=N names the GPUs it plans for), "
                "or probe.rehearse=auto to probe the processes running"
            )
        return 0
    return planned if setting is True or planned > 1 else 0


def local_dtype(run: RunConfig) -> tuple[str, str]:
    """bf16 where the device supports it, fp16 with loss scaling on GPUs without it, fp32 on CPU."""
    if run.train.precision != "auto":
        return run.train.precision, "set by train.precision"
    if run.hw.memory_gib is None and not torch.cuda.is_available():
        return "fp32", "no GPU: fp32 (bf16 autocast on CPU is slow and gains no memory that matters here)"
    if run.hw.bf16 and (run.hw.memory_gib is not None or torch.cuda.is_bf16_supported()):
        return "bf16", "the card supports bfloat16: half the memory of fp32, no loss scaling needed"
    return "fp16", "no bfloat16 on this card: fp16 with dynamic loss scaling"


def step_down(plan_or_choices: Plan | Choices, run: RunConfig, arch, world_size: int) -> Choices | None:
    """The next, slower but smaller configuration, or None when the ladder is exhausted.

    Rungs, cheapest first (cost measured on an H100, bench/RESULTS.md): halve the micro-batch (doubling
    accumulation, same global batch); chunked loss (1,024 tokens: one extra head matmul per chunk, ~2 % of a
    step); checkpointing (unless forced off: one extra forward, ~25-30 %); a 256-token loss chunk; checkpointed
    block inputs in pinned CPU memory (40 x tokens x 4096 x 2 B leave the card: 2.5 GiB at 8K; two PCIe copies
    per block and step, overlapped with compute); ZeRO-3 (world_size > 1, unless dist.strategy=ddp: weights
    gathered every step, 6x slower than plain LoRA on one H100 even without a second GPU to talk to; before
    sequence parallelism because that shards activations, never the weights); under sequence_parallel=auto the
    next degree (plan/sequence.py: 1/N of the activations, accumulation x N; 12 exchanges of q, k, v and the
    output per block and step: 1.6 % of a CPU step at SP 2, 5.9 % at SP 4 over gloo, bench/RESULTS.md); last,
    the tiled MLP (one more MLP forward per step: derived ~+18 % at 8K, ~+6 % at 128K, more than SP's
    exchanges; only when a rank's micro-batch outgrows a tile). The optimizer is never
    offloaded: LoRA's Adam states are megabytes. Nor are the parameters: measured on an H100, DeepSpeed
    0.19.8's parameter offload still held the whole model on the card (bench/RESULTS.md), so it fits
    nothing that ZeRO-3 without it does not."""
    c = plan_or_choices.choices if isinstance(plan_or_choices, Plan) else plan_or_choices
    ckpt_allowed = run.train.gradient_checkpointing != "off"
    if c.micro_batch_size > 1:
        return replace(c, micro_batch_size=c.micro_batch_size // 2, grad_accum=c.grad_accum * 2)
    if c.loss_chunk_tokens == 0:
        return replace(c, loss_chunk_tokens=LOSS_CHUNK)
    if not c.gradient_checkpointing and ckpt_allowed:
        return replace(c, gradient_checkpointing=True)
    if c.loss_chunk_tokens > LOSS_CHUNK_SMALL:
        return replace(c, loss_chunk_tokens=LOSS_CHUNK_SMALL)
    if c.gradient_checkpointing and not c.offload_checkpoints:
        return replace(c, offload_checkpoints=True)
    if c.zero_stage == 0 and max(world_size, c.world_size) * c.sequence_parallel > 1 and allows_zero3(run):
        return replace(c, zero_stage=3)
    wider = sequence.next_degree(c, run, arch)
    if wider is not None:
        return wider
    tile = tile_tokens(arch)  # plan/tiledmlp.py
    local = c.micro_batch_size * longctx.shard_length(c.max_length, c.sequence_parallel)  # a rank's tokens
    if run.train.tiled_mlp == "auto" and c.mlp_tile_tokens == 0 and local > tile:
        return replace(c, mlp_tile_tokens=tile)
    return None


def _budget(run: RunConfig, margin: float) -> int | None:
    if run.hw.memory_gib is not None:
        return int(run.hw.memory_gib * GIB * margin)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory * margin)
    return None


def make_plan(
    run: RunConfig,
    arch,
    world_size: int,
    user_set_max_length: bool,
    data_max_tokens: int | None = None,
    margin: float | None = None,
    packed: tuple[int, int] | None = None,
    advice: bool = True,
    data_tokens: int = 0,
    user_ds: userds.UserDeepSpeed | None = None,
) -> Plan:
    """world_size: the processes of the launch; the plan's width (Choices.world_size) is that over the
    sequence-parallel degree. data_tokens: the tokenized set's size, for the host budget (0 = unknown).
    user_ds: dist.deepspeed_config as config/userds.load read it; the plan starts from its offloads."""
    budget = _budget(run, run.hw.margin if margin is None else margin)
    processes, sp = world_size, sequence.first_degree(run, arch, world_size)
    world_size = processes // sp
    dtype, why_dtype = local_dtype(run)
    max_length = run.data.max_length if user_set_max_length else DEFAULT_MAX_LENGTH
    c = Choices(
        dtype=dtype,
        gradient_checkpointing=run.train.gradient_checkpointing == "on",
        zero_stage=3 if run.dist.strategy == "zero3" else 0,  # the offloads: the user's file's, else none
        offload_params=bool(user_ds and user_ds.offload_params),
        offload_optimizer=bool(user_ds and user_ds.offload_optimizer),
        micro_batch_size=run.train.per_device_batch_size,
        grad_accum=run.train.grad_accum,
        max_length=max_length,
        world_size=world_size,
        eval_batch_size=run.train.eval_batch_size,
        sequence_parallel=sp,
        mlp_tile_tokens=tile_tokens(arch) if run.train.tiled_mlp == "on" else 0,
    )
    reasons = {
        "dtype": why_dtype,
        "max_length": "set by data.max_length"
        if user_set_max_length
        else f"default {DEFAULT_MAX_LENGTH} tokens (data.max_length not set)",
    }

    def peak(ch: Choices, evaluating: bool = True):
        shape = run_shape(run, arch, ch, data_max_tokens, packed, data_tokens)
        return estimate(arch, shape if evaluating else replace(shape, eval_batch=0))

    def fits(ch: Choices, evaluating: bool = True) -> bool:
        est = None if budget is None else peak(ch, evaluating)  # and one node's RAM: the second budget
        return est is None or (est.peak_bytes <= budget and host_figures(est, run, True)["fits"])

    # Frozen weights alone exceed one card: only ZeRO-3 over several GPUs shards them.
    weights_only = peak(c).breakdown.get("frozen weights", 0)
    if (
        budget is not None
        and weights_only > budget
        and processes > 1
        and run.dist.strategy == "auto"
        and allows_zero3(run)
    ):
        c = replace(c, zero_stage=3)
    start = c
    # Training first: a smaller evaluation batch costs the training nothing, so it must not push the
    # training down the ladder. Then halve the evaluation batch until it fits too, and only if evaluating one
    # example at a time still does not fit, go further down (a smaller loss chunk helps evaluation as well).
    for evaluating in (False, True):
        while not fits(c, evaluating):
            if evaluating and c.eval_batch_size > 1:
                c = replace(c, eval_batch_size=c.eval_batch_size // 2)
                continue
            nxt = step_down(c, run, arch, c.world_size)
            if nxt is None:
                break
            c = nxt
    if c.offload_checkpoints and not fits(c) and fits(replace(c, offload_checkpoints=False)):
        c = replace(c, offload_checkpoints=False)  # a later rung made the offload unneeded, and the host is short
    est = peak(c)
    host = host_figures(est, run, budget is not None)
    ok = (budget is None or est.peak_bytes <= budget) and host["fits"]
    reasons.update(decision_reasons(run, start, c, budget, weights_only, processes, ok))
    reasons["sequence_parallel"] = sequence.reason(run, arch, c, processes)
    reasons["host"] = host_reason(host, sequence.shape_fields(run, c, 0)["ranks_per_node"])
    sources = term_sources(est.breakdown, run_shape(run, arch, c, data_max_tokens, packed))
    plan = Plan(
        ok,
        budget,
        est.peak_bytes,
        est.breakdown,
        c,
        reasons,
        sources=sources,
        unmeasured_risk=derived_near_budget(est.breakdown, sources, est.peak_bytes, budget) if ok else "",
        packing=packing_figures(run, arch, c, data_max_tokens, packed),
        host=host,
    )
    if plan.packing:
        reasons["packed_attention"] = path_reason(run.train.packed_attention, plan.packing)
    if not ok and advice and budget is not None:  # the options are other cards and levers for a card budget
        plan.advice = _advice(run, arch, processes, c.max_length, data_max_tokens, margin, packed, data_tokens, user_ds)
    return plan


def _advice(
    run,
    arch,
    world_size: int,
    max_length: int,
    data_max_tokens,
    margin,
    packed: tuple[int, int] | None = None,
    data_tokens: int = 0,
    user_ds=None,
) -> list[str]:
    """The overrides that would fit, each one planned again (plan/advice.py); empty when none does."""

    def replan(changed: RunConfig, world: int) -> Plan:
        return make_plan(changed, arch, world, True, data_max_tokens, margin, packed, False, data_tokens, user_ds)

    return advise(run, world_size, max_length, replan)
