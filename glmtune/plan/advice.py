"""What would fit when the plan does not: every suggestion is re-planned, and printed only if it fits.

Four levers, cheapest change first, each tried by planning the changed run exactly as the command line would
compose it:
  - shorter examples: the longest data.max_length that fits, a multiple of LENGTH_STEP;
  - more GPUs: the fewest that fit, one node of hw.gpus_per_node first, then whole nodes (up to
    MAX_NODES); ZeRO-3 shards the frozen weights over them (dist=ddp never does, so it becomes zero3);
  - a quantized base (plan/quantized.py);
  - another card: the MAX_CARDS smallest conf/hw presets that fit (`+hw=NAME`), keeping this run's hw.margin
    and GPU count.
A lever that cannot fit at any setting (activations of one sequence alone over budget, say) is not
mentioned. Each line starts with the overrides to type, then what it means and its estimate, so a line
can be pasted onto the command line as it is (tests/test_advice.py does exactly that).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import yaml

from ..config import CONF_DIR, HwConfig, RunConfig
from .estimate import GIB

MAX_NODES = 8  # the GPU search stops at 8 nodes x hw.gpus_per_node
LENGTH_STEP = 64  # suggested lengths are multiples of 64 tokens: tidy numbers, at most 63 tokens below the limit
MAX_CARDS = 3  # other cards offered: the smallest that fit (a bigger card always fits too)


def hw_presets() -> dict[str, HwConfig]:
    """conf/hw/*.yaml by name (the same files `+hw=NAME` composes)."""
    return {p.stem: HwConfig(**yaml.safe_load(p.read_text())) for p in sorted((CONF_DIR / "hw").glob("*.yaml"))}


def _line(overrides: list[str], what: str, plan) -> str:
    return (f"{' '.join(overrides)}: {what}, estimated {plan.peak_bytes / GIB:.1f} of "
            f"{plan.budget_bytes / GIB:.1f} GiB")


def advise(run: RunConfig, world_size: int, max_length: int, replan: Callable[[RunConfig, int], object],
           quantize: Callable[[], list[str]] = list) -> list[str]:
    """Suggestions that fit, cheapest change first, each as `overrides: what, estimated X of Y GiB`: a shorter
    length (same hardware, same numerics), more GPUs of this card, a quantized base (`quantize()`, from
    plan/quantized.py: changes the numerics), then at most MAX_CARDS other cards, smallest first (new hardware).

    `replan(run, world_size)` is the planner itself (without advice); `max_length` is the planned length."""
    base = replace(run, data=replace(run.data, max_length=max_length))
    return (_length(base, world_size, max_length, replan) + _gpus(run, base, world_size, replan) + quantize()
            + _cards(run, base, world_size, replan)[:MAX_CARDS])


def _cards(run: RunConfig, base: RunConfig, world_size: int, replan) -> list[str]:
    out = []
    for name, hw in sorted(hw_presets().items(), key=lambda item: item[1].memory_gib):  # smallest first
        if name == run.hw.name or len(out) == MAX_CARDS:
            continue
        plan = replan(replace(base, hw=replace(hw, margin=run.hw.margin)), world_size)
        if plan.fits:
            out.append(_line([f"+hw={name}"], f"the {name} preset ({hw.memory_gib} GiB per GPU)", plan))
    return out


def _gpus(run: RunConfig, base: RunConfig, world_size: int, replan) -> list[str]:
    """The fewest GPUs of this card that fit: one node of hw.gpus_per_node first, then whole nodes."""
    per_node = max(run.hw.gpus_per_node, 1)
    counts = [n for n in range(world_size + 1, per_node + 1)]
    counts += [k * per_node for k in range(2, MAX_NODES + 1) if k * per_node > world_size]
    strategy = "zero3" if run.dist.strategy == "ddp" else run.dist.strategy
    for n in counts:
        nodes, procs = (1, n) if n <= per_node else (n // per_node, per_node)
        plan = replan(replace(base, dist=replace(run.dist, strategy=strategy, nnodes=nodes, nproc_per_node=procs)), n)
        if not plan.fits:
            continue
        overrides = ([f"dist.nnodes={nodes}"] if nodes > 1 else []) + [f"dist.nproc_per_node={procs}"]
        if strategy != run.dist.strategy:
            overrides.append(f"dist.strategy={strategy}")
        launch = (f"torchrun --nproc_per_node {procs}" if nodes == 1 else
                  f"{nodes} nodes of torchrun --nproc_per_node {procs}")
        zero = "ZeRO-3" if plan.choices.zero_stage == 3 else "data parallel"
        return [_line(overrides, f"{n} GPUs with {zero} (mode=plan reads these keys; train with {launch})", plan)]
    return []


def _length(base: RunConfig, world_size: int, max_length: int, replan) -> list[str]:
    """The longest data.max_length that fits, a multiple of LENGTH_STEP."""
    def fits_at(length: int):
        plan = replan(replace(base, data=replace(base.data, max_length=length)), world_size)
        return plan if plan.fits else None

    lo, hi = 1, max_length // LENGTH_STEP  # in steps; hi * LENGTH_STEP <= max_length, which does not fit
    if hi * LENGTH_STEP == max_length:
        hi -= 1
    best = None
    while lo <= hi:  # the longest multiple of LENGTH_STEP that fits (peak grows with length)
        mid = (lo + hi) // 2
        plan = fits_at(mid * LENGTH_STEP)
        if plan:
            best, lo = (mid * LENGTH_STEP, plan), mid + 1
        else:
            hi = mid - 1
    return [_line([f"data.max_length={best[0]}"], "shorter examples (longer ones are cut)", best[1])] if best else []


def cards_for_measured(run: RunConfig, measured_peak: int) -> list[str]:
    """After the probe measured more than the budget on every rung: the presets whose budget holds the
    smallest peak it measured. Measured, not re-planned: the estimate was already shown to be too low."""
    out = []
    for name, hw in sorted(hw_presets().items(), key=lambda item: item[1].memory_gib):
        budget = hw.memory_gib * GIB * run.hw.margin
        if name != run.hw.name and budget >= measured_peak:
            out.append(f"+hw={name}: the {name} preset ({hw.memory_gib} GiB per GPU), measured "
                       f"{measured_peak / GIB:.1f} of {budget / GIB:.1f} GiB")
    return out
