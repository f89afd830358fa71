"""The examples of each optimizer step, the same however the plan splits the step.

The planner's levers split a global batch of G examples into micro-batch × accumulation × processes. For that
split to change memory and speed but never the result, three things must not depend on it:

1. Which examples a step trains. Epoch e's order is a permutation seeded by (train.seed, e) alone, cut into
   blocks of G: block k is step k's examples. The Trainer's loaders hand rank r the micro-batches r, r+W, ...
   of that order (accelerate's batch sharding), so every split of G covers exactly block k in step k.
2. How much each token weighs. Every slot of a step carries the step's target-token count N (all ranks, all
   micro-batches: computed from the examples' recorded target counts, so no communication is needed); the
   trainer turns each micro-batch's *summed* token loss into sum × accumulation × W / N, which the Trainer's
   division by the accumulation steps and DDP's/ZeRO's average over ranks turn back into sum / N: the mean over
   every target token of the step.
3. Where the data stands. An epoch whose size is not a multiple of G ends with a short block, filled with null
   slots (a copy of a real example with every label masked: no loss, no gradient, but every rank still runs the
   same forward passes, which ZeRO-3's collectives need). Nothing is dropped and nothing is seen twice; a resume
   with another split skips whole blocks, so it continues with the next unconsumed example.

Packing (data/packing.py, data.packing=on) changes none of this: StepCollator lays each micro-batch's examples,
the ones listed above, into fewer rows, and the summed token loss of those rows is the summed loss of the examples.

`train.loss_normalization=micro_batch` keeps the official demo's weighting (each micro-batch's mean, averaged
over accumulation steps and ranks) for reproducing its numbers, over the same step order (a micro-batch of null
slots only adds 0); the two agree at 1 × 1 × 1.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..data.pipeline import IGNORE_INDEX

NULL = -1  # a padding slot of an epoch's last, short block


def target_counts(dataset) -> np.ndarray:
    """Target tokens per example as the loss counts them (labels[1:] not masked)."""
    if hasattr(dataset, "target_counts"):
        return np.asarray(dataset.target_counts(), dtype=np.int64)
    return np.array(
        [sum(label != IGNORE_INDEX for label in dataset[i]["labels"][1:]) for i in range(len(dataset))], dtype=np.int64
    )


class StepSampler(torch.utils.data.Sampler):
    """Yields (example index or NULL, the step's target tokens) in step order; see the module docstring.

    repeat (dist.sequence_parallel = N): each micro-batch of `micro_batch` examples is yielded N times in a row,
    so the N ranks of a sequence-parallel group receive the same one (train/sequence.py)."""

    def __init__(self, counts: np.ndarray, global_batch: int, seed: int, micro_batch: int = 1, repeat: int = 1) -> None:
        self.counts, self.global_batch, self.seed, self.epoch = counts, global_batch, seed, 0
        self.micro_batch, self.repeat = micro_batch, repeat

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.counts) / self.global_batch)

    def __len__(self) -> int:
        return self.steps_per_epoch() * self.global_batch * self.repeat

    def order(self, epoch: int) -> np.ndarray:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.counts), generator=generator).numpy()
        # The epoch's blocks, padded to whole steps; not len(self), which counts each micro-batch `repeat` times
        # (a longer order would add steps of null slots after every epoch under sequence parallelism).
        return np.concatenate([order, np.full(self.steps_per_epoch() * self.global_batch - len(order), NULL)])

    def __iter__(self):
        order = self.order(self.epoch)
        for start in range(0, len(order), self.global_batch):
            block = order[start : start + self.global_batch]
            tokens = int(self.counts[block[block != NULL]].sum())
            for first in range(0, len(block), self.micro_batch):
                for _ in range(self.repeat):
                    for index in block[first : first + self.micro_batch]:
                        yield int(index), tokens


class StepExamples(torch.utils.data.Dataset):
    """The training set as the step sampler addresses it: (index, step tokens) -> the example plus both."""

    def __init__(self, dataset, sampler: StepSampler) -> None:
        self.dataset, self.sampler = dataset, sampler

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:  # accelerate forwards the epoch here when the sampler is wrapped
        self.sampler.set_epoch(epoch)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        index, tokens = key
        if index == NULL:  # the shape of a real example, nothing to learn from it
            example = dict(self.dataset[0])
            example["labels"] = [IGNORE_INDEX] * len(example["labels"])
        else:
            example = dict(self.dataset[index])
        return {**example, "example_id": index, "step_tokens": tokens}


class StepCollator:
    """The data collator, plus `step_tokens` (the step's target tokens) and `example_ids` (NULL for padding).

    packer (data.packing.RowPacker, data.packing=on): the micro-batch's examples, the same ones as unpacked, go
    into rows first; its null slots carry no target and are left out, unless the micro-batch is nothing else (one
    null row then still runs the forward every rank's collectives expect). Evaluation batches stay unpacked."""

    def __init__(self, collator: Callable, packer: Callable | None = None) -> None:
        self.collator, self.packer = collator, packer

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "step_tokens" not in features[0]:  # the evaluation loader shares the Trainer's collator
            return self.collator(features)
        ids = [f.pop("example_id") for f in features]
        tokens = {f.pop("step_tokens") for f in features}
        assert len(tokens) == 1, "a micro-batch spans two optimizer steps"  # G is a multiple of the micro-batch
        if self.packer is not None:
            real = [f for f, i in zip(features, ids) if i != NULL]
            features = self.packer(real or features[:1])
        batch = self.collator(features)
        batch["example_ids"] = torch.tensor(ids, dtype=torch.long)
        batch["step_tokens"] = torch.tensor(tokens.pop(), dtype=torch.long)
        return batch


class ExampleLog:
    """GLMTUNE_EXAMPLE_LOG=DIR: each rank appends the example ids it trained, with the optimizer step, to
    DIR/examples.rank<N>.jsonl — a check that a resumed or re-split run trains each example once."""

    def __init__(self, rank: int) -> None:
        folder = os.environ.get("GLMTUNE_EXAMPLE_LOG")
        self.path = Path(folder) / f"examples.rank{rank}.jsonl" if folder else None

    def record(self, step: int, ids: torch.Tensor) -> None:
        if self.path is not None:
            with self.path.open("a") as out:
                out.write(json.dumps({"step": step, "ids": [i for i in ids.tolist() if i != NULL]}) + "\n")


def step_loss(summed: torch.Tensor, step_tokens: torch.Tensor, accumulation: int, world: int) -> torch.Tensor:
    """A micro-batch's summed token loss, scaled so that the Trainer's /accumulation and the ranks' average give
    the mean over the step's target tokens (fp32)."""
    return summed.float() * (accumulation * world) / step_tokens.clamp(min=1).to(summed.device, torch.float32)
