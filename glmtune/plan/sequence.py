"""The planner's sequence-parallel rung and its host-memory budget (issue 30).

dist.sequence_parallel = auto lets the planner add Ulysses sequence parallelism as its last rung: after every
cheaper lever (micro-batch, chunked loss, checkpointing, checkpoint offload, ZeRO-3) it tries the next degree N
that divides the processes and the model's heads (models/ulysses.SequenceGroup.check_heads: 32 heads over 2 KV
groups take 2, 4, 8, 16, 32), smallest first. N ranks then share each row, so the data-parallel width is
processes / N; accumulation grows by the same factor, and the global batch (micro x accumulation x width) stays.
An integer is taken as given. The micro-batch loss mean (a shard's mean is not the row's) keeps N = 1. GLM-4V is
sharded after the image merge (models/modeling_glm4.merge_images): every rank of a group runs the tower on the
whole images, the rows it keeps are 1/N of the merged rows.

The host is the second budget: one node's RAM (hw.host_memory_gib, or this machine's MemAvailable) must hold
what plan/longctx.host_breakdown counts; a plan whose card part fits and whose host part does not is refused.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError, RunConfig
from ..models.kernels.ulysses import SequenceGroup
from .longctx import host_budget

MAX_DEGREE = 64  # no GLM has more than 32 query heads


def heads_problem(arch, n: int) -> str | None:
    """Why `n` ranks cannot share this model's rows, or None."""
    if n == 1:
        return None
    return SequenceGroup(None, n, 0).check_heads(arch.num_attention_heads, arch.kv_groups)


def degrees(run: RunConfig, arch, processes: int) -> list[int]:
    """The degrees the planner may use, smallest first: [N] for an integer setting, else 1 and every N > 1 that
    divides the processes and the heads."""
    sp = run.dist.sequence_parallel
    if sp != "auto":
        return [sp]
    if run.train.loss_normalization != "tokens":
        return [1]
    return [1] + [n for n in range(2, min(processes, MAX_DEGREE) + 1)
                  if processes % n == 0 and heads_problem(arch, n) is None]


def first_degree(run: RunConfig, arch, processes: int) -> int:
    """The degree the plan starts from; an integer setting that cannot work is one line (exit 2)."""
    sp = run.dist.sequence_parallel
    if sp == "auto":
        return 1
    if processes % sp:
        raise ConfigError(f"dist.sequence_parallel={sp} must divide the {processes} processes of the launch — use a "
                          f"divisor of {processes}, or launch a multiple of {sp} processes")
    problem = heads_problem(arch, sp)
    if problem:
        raise ConfigError(f"dist.sequence_parallel={sp}: {problem} — use dist.sequence_parallel=auto or 1")
    return sp


def next_degree(c, run: RunConfig, arch):
    """The Choices one sequence-parallel rung down (global batch kept), or None."""
    processes = c.world_size * c.sequence_parallel
    for n in degrees(run, arch, processes):
        if n > c.sequence_parallel and n % c.sequence_parallel == 0:
            k = n // c.sequence_parallel
            return replace(c, sequence_parallel=n, world_size=processes // n, grad_accum=c.grad_accum * k)
    return None


def host_figures(est, run: RunConfig, gpu_plan: bool) -> dict:
    """plan.json's host block: one node's bytes, its budget, whether it fits, and the terms."""
    budget, source = host_budget(run.hw.host_memory_gib, run.hw.memory_gib is None)
    used = sum(est.host.values())
    # A CPU run's RAM is its card budget: this machine's MemAvailable is checked before training
    # (train/preflight.py); a hw.host_memory_gib given for it must hold the estimate as well as the host terms.
    checked = budget is not None and (gpu_plan or run.hw.host_memory_gib is not None)
    if not gpu_plan:
        used += est.peak_bytes
    return {"bytes": used, "budget_bytes": budget, "budget_source": source,
            "fits": not checked or used <= budget, "breakdown": dict(est.host)}


def host_reason(host: dict, ranks: int) -> str:
    gib = 2**30
    budget = "unknown" if host["budget_bytes"] is None else f"{host['budget_bytes'] / gib:.1f} GiB"
    return (f"{host['bytes'] / gib:.1f} GiB for {ranks} process(es) on a node, budget {budget} "
            f"({host['budget_source']})" + ("" if host["fits"] else ": DOES NOT FIT"))


def shape_fields(run: RunConfig, c, data_tokens: int) -> dict:
    """RunShape's sequence-parallel and host fields: ZeRO-3 shards over every process, SP groups included."""
    processes = c.world_size * c.sequence_parallel
    return dict(world_size=processes, sequence_parallel=c.sequence_parallel, data_tokens=data_tokens,
                ranks_per_node=max(1, processes // max(1, run.dist.nnodes)))


def reasons(run: RunConfig, arch, c, processes: int, host: dict) -> dict[str, str]:
    ranks = shape_fields(run, c, 0)["ranks_per_node"]
    return {"sequence_parallel": reason(run, arch, c, processes), "host": host_reason(host, ranks)}


def batch_reason(start, c) -> str:
    """The plan's micro-batch line: the global batch the rungs kept (micro x accumulation x data-parallel width)."""
    groups = (f"{c.world_size} GPUs" if c.sequence_parallel == 1 else
              f"{c.world_size} group(s) of {c.sequence_parallel} GPUs")
    return (f"{c.micro_batch_size} x grad_accum {c.grad_accum} x {groups} keeps the global batch "
            f"{start.micro_batch_size * start.grad_accum * start.world_size}")


def reason(run: RunConfig, arch, c, processes: int) -> str:
    sp = run.dist.sequence_parallel
    if sp != "auto":
        return f"dist.sequence_parallel={sp}"
    if c.sequence_parallel > 1:
        return (f"{c.sequence_parallel}: whole rows do not fit one card; {c.sequence_parallel} ranks share each row "
                f"(1/{c.sequence_parallel} of the activations, an all-to-all per attention), accumulation x "
                f"{c.sequence_parallel} keeps the global batch")
    if len(degrees(run, arch, processes)) == 1:
        why = ("train.loss_normalization=micro_batch" if run.train.loss_normalization != "tokens" else
               f"no degree > 1 divides the {processes} process(es) and the heads")
        return f"1: {why}"
    return "1: whole rows fit"


def set_tokens(stats) -> int:
    """Tokens of the tokenized train and val splits (data/stats.DataStats), for the host budget."""
    return stats.train.tokens + (stats.val.tokens if stats.val is not None else 0)


def host_rows(host: dict) -> list[tuple[str, str, str]]:
    """The plan table's host rows: each term per node, then the total against its budget."""
    if not host:
        return []
    gib, hb = 2**30, host["budget_bytes"]
    rows = [(f"host: {name}", f"{value / gib:.2f} GiB", "per node") for name, value in host["breakdown"].items()]
    rows.append(("[bold]host RAM per node", f"[bold]{host['bytes'] / gib:.2f} GiB",
                 f"budget {'unknown' if hb is None else f'{hb / gib:.1f} GiB'}: {host['budget_source']}"
                 + ("" if host["fits"] else " — DOES NOT FIT")))
    return rows
