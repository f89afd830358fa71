"""The planner's sequence-parallel rung: which degrees it may use, the next one down, and the reasons it gives.

dist.sequence_parallel = auto lets the planner add Ulysses sequence parallelism as a rung: after every cheaper lever
(micro-batch, chunked loss, checkpointing, checkpoint offload, ZeRO-3) and before the tiled MLP it tries the next
degree N that divides the processes and the model's heads (models/kernels/ulysses.SequenceGroup.check_heads: 32
heads over 2 KV groups take 2, 4, 8, 16, 32), smallest first. N ranks then share each row, so the data-parallel
width is processes / N; accumulation grows by the same factor, and the global batch (micro x accumulation x width)
stays. An integer is taken as given. The micro-batch loss mean (a shard's mean is not the row's) keeps N = 1. GLM-4V
is sharded after the image merge (models/chatglm/modeling.ChatGLMModel.merge_images): every rank of a group runs the
tower on the whole images, the rows it keeps are 1/N of the merged rows.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError, RunConfig
from ..models.kernels.ulysses import SequenceGroup

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
    return [1] + [
        n for n in range(2, min(processes, MAX_DEGREE) + 1) if processes % n == 0 and heads_problem(arch, n) is None
    ]


def first_degree(run: RunConfig, arch, processes: int) -> int:
    """The degree the plan starts from; an integer setting that cannot work is one line (exit 2)."""
    sp = run.dist.sequence_parallel
    if sp == "auto":
        return 1
    if processes % sp:
        raise ConfigError(
            f"dist.sequence_parallel={sp} must divide the {processes} processes of the launch — use a "
            f"divisor of {processes}, or launch a multiple of {sp} processes"
        )
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


def shape_fields(run: RunConfig, c, data_tokens: int) -> dict:
    """RunShape's sequence-parallel and host fields: ZeRO-3 shards over every process, SP groups included."""
    processes = c.world_size * c.sequence_parallel
    return dict(
        world_size=processes,
        sequence_parallel=c.sequence_parallel,
        data_tokens=data_tokens,
        ranks_per_node=max(1, processes // max(1, run.dist.nnodes)),
    )


def batch_reason(start, c) -> str:
    """The plan's micro-batch line: the global batch the rungs kept (micro x accumulation x data-parallel width)."""
    groups = (
        f"{c.world_size} GPUs" if c.sequence_parallel == 1 else f"{c.world_size} group(s) of {c.sequence_parallel} GPUs"
    )
    return (
        f"{c.micro_batch_size} x grad_accum {c.grad_accum} x {groups} keeps the global batch "
        f"{start.micro_batch_size * start.grad_accum * start.world_size}"
    )


def reason(run: RunConfig, arch, c, processes: int) -> str:
    sp = run.dist.sequence_parallel
    if sp != "auto":
        return f"dist.sequence_parallel={sp}"
    if c.sequence_parallel > 1:
        return (
            f"{c.sequence_parallel}: whole rows do not fit one card; {c.sequence_parallel} ranks share each row "
            f"(1/{c.sequence_parallel} of the activations, an all-to-all per attention), accumulation x "
            f"{c.sequence_parallel} keeps the global batch"
        )
    if len(degrees(run, arch, processes)) == 1:
        why = (
            "train.loss_normalization=micro_batch"
            if run.train.loss_normalization != "tokens"
            else f"no degree > 1 divides the {processes} process(es) and the heads"
        )
        return f"1: {why}"
    return "1: whole rows fit"
