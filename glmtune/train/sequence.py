"""Sequence parallelism in training (dist.sequence_parallel = N > 1): N processes share each micro-batch's rows,
each holding a contiguous 1/N of every row through embeddings, MLP, norms and the loss; attention exchanges
shards for heads (models/kernels/ulysses.py). The other factor of the world is data parallel: W processes form W / N
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

GLM-4V: a micro-batch with images reaches the model whole on every rank of the group; each rank runs the (frozen,
adapter-free) vision tower and the image merge on the whole rows and only then keeps its 1/N of the merged rows,
cut the same way (models/chatglm/modeling.py merge_images). The patches' shared position id travels with them.

Evaluation's loss runs under the same layout, so a length that trains also evaluates. Each group is one data-
parallel rank of the evaluation loader (group_eval_loader: the group's N ranks score the same batches, the
groups share the eval set as W / N processes would); each rank sums its shard's token losses, the group adds
them up and divides by the batch's target tokens (group_mean_loss): the model's own mean over the whole batch.
The Trainer then averages those batch means as it does without sequence parallelism, counting each group once
(gather_groups): the eval loss is the one W / N processes without it report. eval.generate decodes whole rows
(a KV cache grows one token at a time on every rank; it cannot be cut along the sequence): every rank generates
for the whole prompts, and the plan budgets that cache at the whole row length.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, SequentialSampler

from ..config import ConfigError
from ..data.pipeline import IGNORE_INDEX
from ..models.kernels.ulysses import PAD_FILL, SequenceGroup, pad_and_shard, shift_labels


def sequence_group(size: int) -> SequenceGroup | None:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as torch requires);
    None for size 1. In a rehearsal (probe/rehearse.py) they are the world's kind: train/rehearsal.RehearsalGroup."""
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


def data_parallel_width(world: int, size: int) -> int:
    """The plan's width: each group of `size` ranks trains its own micro-batches, so the global batch is
    micro x accumulation x world / size (the planner's own check: plan/sequence.py)."""
    if world % size:
        raise ConfigError(
            f"dist.sequence_parallel={size} must divide the {world} processes of the launch — use a "
            f"divisor of {world}, or launch a multiple of {size} processes"
        )
    return world // size


# Keys of a training micro-batch laid out along the sequence ([B, S]); a padded position takes ulysses.PAD_FILL.
SEQUENCE_KEYS = ("labels", "input_ids", "attention_mask", "position_ids", "seq_ids")


def shard_batch(inputs: dict[str, torch.Tensor], sp: SequenceGroup) -> dict[str, torch.Tensor]:
    """This rank's contiguous 1/N of every row: labels shifted to the token each position predicts first, then
    every [B, S] tensor right-padded to a multiple of N and cut. The model then takes the labels as given
    (ChatGLMForConditionalGeneration: no shift under a sequence group).

    A GLM-4V batch with images is returned whole: its rows only take their final length when the model splices
    the image patches in, so the model cuts them itself after the merge (ChatGLMModel.merge_images), the same way."""
    images = inputs.get("images")
    if images is not None and len(images):
        return inputs
    s = inputs["labels"].shape[1]
    out = dict(inputs)
    out["labels"] = shift_labels(inputs["labels"])
    for key in SEQUENCE_KEYS:
        value = out.get(key)
        if value is None or value.dim() != 2 or value.shape[1] != s:
            continue
        out[key] = pad_and_shard(value, PAD_FILL[key], sp)
    return out


def group_mean_loss(summed: torch.Tensor, labels: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """The mean token loss of a whole evaluation batch from this rank's summed loss over its shard: the group's
    sums added up, over the batch's target tokens (labels [B, S] before the shift and the cut: labels[1:] not
    masked, as the model's own mean and the training step counts count them; an image's patches add none)."""
    total = summed.detach().float().clone()
    dist.all_reduce(total, group=sp.group)
    return total / (labels[:, 1:] != IGNORE_INDEX).sum().to(total.device)


def group_eval_loader(dataset, collator, args, accelerator, size: int) -> DataLoader:
    """The Trainer's evaluation loader (eval batch, in order), sharded over the W / size groups instead of the W
    ranks: group g's ranks all get the batches that rank g of W / size processes would."""
    loader = DataLoader(
        dataset,
        batch_size=args.eval_batch_size,
        sampler=SequentialSampler(dataset),
        collate_fn=collator,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        drop_last=args.dataloader_drop_last,
    )
    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=accelerator.num_processes // size,
        process_index=accelerator.process_index // size,
        put_on_device=accelerator.device_placement,
        even_batches=accelerator.even_batches,
    )


def gather_groups(accelerator, size: int, tensor: torch.Tensor) -> torch.Tensor:
    """accelerate's gather_for_metrics for group_eval_loader: the values of every rank in rank order, one rank
    per group kept (its N ranks hold the same batch means), then the last round's filler cut off as
    gather_for_metrics cuts it (the loader's remainder is counted over the groups)."""
    data = accelerator.gather(tensor)
    data = data.view(accelerator.num_processes, -1, *tensor.shape[1:])[::size].flatten(0, 1)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        data = data[: state.remainder]
    return data
