"""What would fit when the plan does not: a short ranked list of options, each re-planned, each with its estimate
and headroom, and none that would leave less than MIN_HEADROOM of the budget free.

The levers, each tried by planning the changed run exactly as the command line would compose it:
  - shorter examples: the longest data.max_length that fits, a multiple of LENGTH_STEP;
  - more GPUs: the fewest that fit, one node of hw.gpus_per_node first, then whole nodes (up to MAX_NODES);
    ZeRO-3 shards the frozen weights over them (dist=ddp never does, so it becomes zero3);
  - a quantized base (nf4, int8; plan/quantized.py sizes it), and when it does not fit alone, a quantized base
    with the longest length that then fits (the combination neither lever reaches by itself);
  - another card: the MAX_CARDS smallest conf/hw presets that fit (`+hw=NAME`), keeping hw.margin and GPU count.
Ranked cheapest change first: the same run on the same hardware with shorter examples, then more of the same
GPUs, then changed numerics (quantized; with shorter examples after), then new hardware. A lever that cannot fit
at any setting is not mentioned. Each line starts with the overrides to type, so it can be pasted onto the command
line as it is (tests/plan/test_advice.py does exactly that), then what it means, its estimate and its headroom.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from typing import Callable

import yaml

from ..config import CONF_DIR, HwConfig, RunConfig
from ..config.units import GIB
from .host import HOST_MARGIN

MAX_NODES = 8  # the GPU search stops at 8 nodes x hw.gpus_per_node
LENGTH_STEP = 64  # suggested lengths are multiples of 64 tokens: tidy numbers, at most 63 tokens below the limit
MAX_CARDS = 3  # other cards offered: the smallest that fit (a bigger card always fits too)
MAX_OPTIONS = 6  # the list a person reads at exit 3; the cheapest ones
# An option must leave 2 % of the budget free: a plan at 13.1 of 13.1 GiB rests on every term being exact to the
# MiB, and the budget's own margin (hw.margin) is for what no estimate sees (fragmentation, a driver's growth).
MIN_HEADROOM = 0.02
INT8_FIRST = 0.05  # int8 (closer to bf16) is offered before nf4 only when it leaves this much of the budget free
MAX_SCAN = 256  # lengths tried one LENGTH_STEP at a time below the longest that fits (_longest)
WIDTH = 120  # columns of a printed option (a log file, SLURM output, CI)


@dataclass
class Option:
    overrides: list[str]
    what: str
    peak_bytes: int
    budget_bytes: int

    @property
    def headroom(self) -> float:
        return 1 - self.peak_bytes / self.budget_bytes

    def line(self) -> str:
        return (
            f"{' '.join(self.overrides)}: {self.what}, estimated {self.peak_bytes / GIB:.1f} of "
            f"{self.budget_bytes / GIB:.1f} GiB ({100 * self.headroom:.1f} % headroom)"
        )


def comfortable(plan) -> bool:
    """Fits with MIN_HEADROOM of the budget to spare."""
    return plan.fits and (plan.budget_bytes is None or plan.peak_bytes <= (1 - MIN_HEADROOM) * plan.budget_bytes)


def _option(overrides: list[str], what: str, plan) -> Option:
    return Option(overrides, what, plan.peak_bytes, plan.budget_bytes)


def format_options(lines: list[str]) -> str:
    """The numbered list under the plan table, each option wrapped at WIDTH columns under its number."""
    if not lines:
        return ""
    out = ["what would fit, best first (type the overrides before the colon):"]
    for i, line in enumerate(lines, 1):
        out.append(
            textwrap.fill(
                line,
                WIDTH,
                initial_indent=f"  {i}. ",
                subsequent_indent="     ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)


def hw_presets() -> dict[str, HwConfig]:
    """conf/hw/*.yaml by name (the same files `+hw=NAME` composes)."""
    return {p.stem: HwConfig(**yaml.safe_load(p.read_text())) for p in sorted((CONF_DIR / "hw").glob("*.yaml"))}


def advise(run: RunConfig, world_size: int, max_length: int, replan: Callable[[RunConfig, int], object]) -> list[str]:
    """The options that fit with MIN_HEADROOM, cheapest change first, at most MAX_OPTIONS, each as
    `overrides: what, estimated X of Y GiB (H % headroom)`.

    `replan(run, world_size)` is the planner itself (without advice); `max_length` is the planned length."""
    base = replace(run, data=replace(run.data, max_length=max_length))
    shorter = _length(base, world_size, max_length, replan)
    options = (
        [_option([f"data.max_length={shorter[0]}"], "shorter examples (longer ones are cut)", shorter[1])]
        if shorter
        else []
    )
    options += _gpus(run, base, world_size, replan)
    options += _quantized(run, base, world_size, max_length, replan, shorter[0] if shorter else 0)
    options += _host(run, base, world_size, replan)
    options += _cards(run, base, world_size, replan)
    return [o.line() for o in options[:MAX_OPTIONS]]


def _longest(plan_at: Callable[[int], object], max_length: int):
    """(the longest multiple of LENGTH_STEP below max_length whose plan is comfortable, that plan), or None.

    Whether a length fits is monotonic (binary search); its headroom is not: as the length drops the planner
    spends what it frees on speed (checkpointing off, a larger evaluation batch) and lands near the budget again.
    So from the longest that fits, down one LENGTH_STEP at a time to the first with MIN_HEADROOM (~7 ms a plan;
    at most MAX_SCAN of them, then a binary search below)."""

    def search(lo: int, hi: int, ok: Callable) -> tuple[int, object] | None:
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            plan = plan_at(mid * LENGTH_STEP)
            if ok(plan):
                best, lo = (mid * LENGTH_STEP, plan), mid + 1
            else:
                hi = mid - 1
        return best

    top = (max_length - 1) // LENGTH_STEP  # in steps: top * LENGTH_STEP < max_length, which does not fit
    fitting = search(1, top, lambda plan: plan.fits)
    if fitting is None:
        return None
    steps = fitting[0] // LENGTH_STEP
    for n in range(steps, max(steps - MAX_SCAN, 0), -1):
        plan = fitting[1] if n == steps else plan_at(n * LENGTH_STEP)
        if comfortable(plan):
            return n * LENGTH_STEP, plan
    return search(1, steps - MAX_SCAN, comfortable)


def _length(base: RunConfig, world_size: int, max_length: int, replan):
    return _longest(lambda n: replan(replace(base, data=replace(base.data, max_length=n)), world_size), max_length)


def _gpus(run: RunConfig, base: RunConfig, world_size: int, replan) -> list[Option]:
    """The fewest GPUs of this card that fit: one node of hw.gpus_per_node first, then whole nodes."""
    per_node = max(run.hw.gpus_per_node, 1)
    counts = [n for n in range(world_size + 1, per_node + 1)]
    counts += [k * per_node for k in range(2, MAX_NODES + 1) if k * per_node > world_size]
    strategy = "zero3" if run.dist.strategy == "ddp" else run.dist.strategy
    for n in counts:
        nodes, procs = (1, n) if n <= per_node else (n // per_node, per_node)
        plan = replan(replace(base, dist=replace(run.dist, strategy=strategy, nnodes=nodes, nproc_per_node=procs)), n)
        if not comfortable(plan):
            continue
        overrides = ([f"dist.nnodes={nodes}"] if nodes > 1 else []) + [f"dist.nproc_per_node={procs}"]
        if strategy != run.dist.strategy:
            overrides.append(f"dist.strategy={strategy}")
        launch = (
            f"scripts/torchrun.sh {procs}"
            if nodes == 1
            else f"NNODES={nodes} NPROC={procs} scripts/torchrun_multinode.sh on each node"
        )
        zero = "ZeRO-3" if plan.choices.zero_stage == 3 else "data parallel"
        if plan.choices.sequence_parallel > 1:  # the planner's SP rung (plan/sequence.py)
            zero += f", {plan.choices.sequence_parallel} GPUs sharing each row"
        return [_option(overrides, f"{n} GPUs with {zero} (mode=plan reads these keys; train with {launch})", plan)]
    return []


def _quantized(run: RunConfig, base: RunConfig, world_size: int, max_length: int, replan, shorter: int) -> list[Option]:
    """A quantized base alone where it fits (int8 first when it leaves INT8_FIRST free, else nf4 first); when
    neither does, each with the longest length that then fits, if longer than `shorter` (the length that fits
    without quantizing, which changes less)."""
    if run.model.quantize != "none" or run.model.trust_remote_code:
        return []
    # ZeRO-3 cannot shard bitsandbytes weights (plan/quantized.py allows_zero3): a zero3 run goes back to auto.
    also = ["dist.strategy=auto"] if run.dist.strategy == "zero3" else []
    what = "quantize the frozen base weights (QLoRA; changes the numerics)"
    trials = {
        mode: replace(
            base, model=replace(run.model, quantize=mode), dist=replace(run.dist, strategy="auto") if also else run.dist
        )
        for mode in ("int8", "nf4")
    }
    alone = {mode: plan for mode, trial in trials.items() if comfortable(plan := replan(trial, world_size))}
    if alone:
        int8 = alone.get("int8")
        order = ("int8", "nf4") if int8 and int8.peak_bytes <= (1 - INT8_FIRST) * int8.budget_bytes else ("nf4", "int8")
        return [_option([f"model.quantize={m}", *also], what, alone[m]) for m in order if m in alone]
    combined = []
    for mode, trial in trials.items():
        found = _longest(
            lambda n: replan(replace(trial, data=replace(trial.data, max_length=n)), world_size), max_length
        )
        if found and found[0] > shorter:
            combined.append(
                _option(
                    [f"model.quantize={mode}", f"data.max_length={found[0]}", *also],
                    f"{what}, and cut examples to {found[0]} tokens",
                    found[1],
                )
            )
    return sorted(combined, key=lambda o: -int(o.overrides[1].split("=")[1]))  # the longer examples first


def _cards(run: RunConfig, base: RunConfig, world_size: int, replan) -> list[Option]:
    out = []
    for name, hw in sorted(hw_presets().items(), key=lambda item: item[1].memory_gib):  # smallest first
        if name == run.hw.name or len(out) == MAX_CARDS:
            continue
        # Another card in the same node: the node's RAM (hw.host_memory_gib) stays the run's.
        plan = replan(
            replace(base, hw=replace(hw, margin=run.hw.margin, host_memory_gib=run.hw.host_memory_gib)), world_size
        )
        if comfortable(plan):
            out.append(_option([f"+hw={name}"], f"the {name} preset ({hw.memory_gib} GiB per GPU)", plan))
    return out


HOST_SIZES = (64, 128, 256, 512, 1024, 2048)  # GiB of RAM per node offered when the host budget is what fails


def _host(run: RunConfig, base: RunConfig, world_size: int, replan) -> list[Option]:
    """A node with more RAM (hw.host_memory_gib), when the host budget is what the plan misses: the smallest
    common size that fits."""
    plan = replan(base, world_size)
    if not plan.host or plan.host.get("fits", True) or plan.host.get("budget_bytes") is None:
        return []
    have = plan.host["budget_bytes"] / GIB
    for size in HOST_SIZES:
        if size * HOST_MARGIN <= have:
            continue
        trial = replan(replace(base, hw=replace(run.hw, host_memory_gib=float(size))), world_size)
        if comfortable(trial):
            return [
                _option(
                    [f"hw.host_memory_gib={size}"],
                    f"a node with {size} GiB of RAM (the host needs {trial.host['bytes'] / GIB:.0f} GiB)",
                    trial,
                )
            ]
    return []


def cards_for_measured(run: RunConfig, measured_peak: int) -> list[str]:
    """After the probe measured more than the budget on every rung: the presets whose budget holds the
    smallest peak it measured with MIN_HEADROOM. Measured, not re-planned: the estimate was already shown low."""
    out = []
    for name, hw in sorted(hw_presets().items(), key=lambda item: item[1].memory_gib):
        budget = hw.memory_gib * GIB * run.hw.margin
        if name != run.hw.name and (1 - MIN_HEADROOM) * budget >= measured_peak:
            out.append(
                f"+hw={name}: the {name} preset ({hw.memory_gib} GiB per GPU), measured "
                f"{measured_peak / GIB:.1f} of {budget / GIB:.1f} GiB"
            )
    return out
