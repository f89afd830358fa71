"""The plan as a table for the console: each breakdown term in GiB with its source, the budgets, each decision
with its reason, and under it the numbered options that would fit."""

from __future__ import annotations

from ..config.units import GIB
from .advice import format_options
from .host import host_rows
from .planner import Plan


def format_plan(plan: Plan):
    """Rich table: breakdown in GiB, then each decision with its reason; under it, the numbered options that
    would fit (plan.advice), wrapped for a 120-column log."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"memory plan: {'fits' if plan.fits else 'DOES NOT FIT'}", show_header=True)
    table.add_column("item")
    table.add_column("value", justify="right")
    table.add_column("why", style="dim")  # the term's source, or the decision's reason: wraps in a 120-column log
    for name, value in plan.breakdown.items():
        table.add_row(name, f"{value / GIB:.2f} GiB", plan.sources.get(name, "").split(" (")[0])
    table.add_row("[bold]estimated peak", f"[bold]{plan.peak_bytes / GIB:.2f} GiB")
    budget = "none (no GPU)" if plan.budget_bytes is None else f"{plan.budget_bytes / GIB:.2f} GiB"
    table.add_row("[bold]budget", budget)
    for row in host_rows(plan.host):  # one node's RAM, the second budget
        table.add_row(*row)
    for key, value in plan.choices.to_dict().items():
        if key == "world_size":  # the planned world; Choices.world_size is its data-parallel width
            table.add_row(key, *world_row(plan.choices))
        else:
            table.add_row(key, str(value), plan.reasons.get(key, ""))
    if plan.packing:
        table.add_row("packing", "on", format_rows(plan.packing))
        table.add_row("packed attention", plan.packing["attention"], plan.reasons.get("packed_attention", ""))
    if plan.unmeasured_risk:
        table.add_row("[yellow]unmeasured", "", plan.unmeasured_risk)
    if not plan.advice:
        return table
    return Group(table, Text(format_options(plan.advice)))


def world_row(c) -> tuple[str, str]:
    """The world_size row: every process (GPU) the plan is for, and under sequence parallelism how they split into
    data-parallel groups (plan.json's choices.world_size counts those groups: what the Trainer divides the batch by)."""
    processes = c.world_size * c.sequence_parallel
    if c.sequence_parallel == 1:
        return str(processes), f"{processes} GPU(s), data parallel" if processes > 1 else "1 GPU"
    return str(processes), (
        f"{processes} GPUs: {c.world_size} data-parallel group(s) of {c.sequence_parallel} "
        "sharing each row (dist.sequence_parallel)"
    )


def format_rows(p: dict) -> str:
    """The plan's packing line: how many rows a micro-step and a step become."""
    expected = f"expected {p['expected_rows_per_micro_step']:.1f}, " if "expected_rows_per_micro_step" in p else ""
    return (
        f"{p['examples_per_micro_step']} examples per micro-step -> {expected}probed "
        f"{p['probed_rows_per_micro_step']} x {p['probed_row_positions']} positions, at most "
        f"{p['most_rows_per_micro_step']} rows; a step: {p['micro_steps_per_step']} micro-steps, at most "
        f"{p['most_rows_per_step']} rows of <= {p['pack_length']}"
    )
