"""Sequence parallelism in training (dist.sequence_parallel = N > 1): N processes share each micro-batch's rows,
each holding a contiguous 1/N of every row through embeddings, MLP, norms and the loss; attention exchanges
shards for heads (models/ulysses.py). The other factor of the world is data parallel: W processes form W / N
groups of N consecutive ranks (one node's GPUs), and each group trains its own micro-batches.

Nothing else about a step changes (train/steps.py):
- The same examples per step. The step sampler hands each micro-batch out N times in a row, so accelerate's
  round-robin sharding (batch j to rank j mod W) gives all N ranks of group g the same micro-batches (those with
  index = g mod W/N); the global batch is micro-batch x accumulation x W / N.
- The same weight per token. Each rank sums the token losses of its shard; step_loss scales that sum by
  accumulation x W / (the step's target tokens), and DDP's or ZeRO's average over all W ranks sums the N shards
  of a row and the W/N groups once each: the mean over the step's target tokens, with no factor of N anywhere.
- The same targets. Labels are shifted on the whole row before it is cut, so the last token of a shard keeps
  the first token of the next shard as its target; rows are padded to a multiple of N with positions that have
  no target (right padding: under causal attention no real token sees them).

Evaluation runs without sequence parallelism (each rank scores whole rows of its own share of the eval set,
as without it); the plan budgets evaluation at the whole row length.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..data.pipeline import IGNORE_INDEX
from ..models.ulysses import SequenceGroup, shard


def sequence_group(size: int) -> SequenceGroup | None:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as torch requires);
    None for size 1."""
    if size <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    data_parallel_width(world, size)  # the plan checked it for the command; here for any other caller
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceGroup.of(mine)


def data_parallel_width(world: int, size: int, vision: bool = False) -> int:
    """The plan's width: each group of `size` ranks trains its own micro-batches, so the global batch is
    micro x accumulation x world / size (the planner's own check: plan/sequence.py). `vision`: the model has an image
    tower (GLM-4V), whose rows are only whole after the image merge: not sharded yet."""
    if size > 1 and vision:
        raise ConfigError(f"dist.sequence_parallel={size} is not available for GLM-4V yet (its rows are cut after "
                          "the image merge): use dist.sequence_parallel=1")
    if world % size:
        raise ConfigError(f"dist.sequence_parallel={size} must divide the {world} processes of the launch — use a "
                          f"divisor of {world}, or launch a multiple of {size} processes")
    return world // size


# Keys of a training micro-batch laid out along the sequence ([B, S]), with the value a padded position takes.
SEQUENCE_KEYS = {"input_ids": 0, "attention_mask": 0, "position_ids": 0, "seq_ids": -1}


def shard_batch(inputs: dict[str, torch.Tensor], sp: SequenceGroup) -> dict[str, torch.Tensor]:
    """This rank's contiguous 1/N of every row: labels shifted to the token each position predicts first, then
    every [B, S] tensor right-padded to a multiple of N and cut. The model then takes the labels as given
    (ChatGLMForConditionalGeneration: no shift under a sequence group)."""
    labels = inputs["labels"]
    b, s = labels.shape
    shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    pad = -s % sp.size
    out = dict(inputs)
    out["labels"] = shifted
    for key in ["labels", *SEQUENCE_KEYS]:
        value = out.get(key)
        if value is None or value.dim() != 2 or value.shape[1] != s:
            continue
        if pad:
            fill = IGNORE_INDEX if key == "labels" else SEQUENCE_KEYS[key]
            value = torch.cat([value, value.new_full((b, pad), fill)], dim=1)
        out[key] = shard(value, sp)
    return out
