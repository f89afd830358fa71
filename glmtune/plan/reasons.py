"""Why the plan chose what it chose: the reason line of each decision, as plan.json, the header and the table
show them.
"""

from __future__ import annotations

import os

from ..config.units import GIB
from . import sequence
from .choices import Choices
from .reserve import ALLOCATORS, allocator_in_force


def decision_reasons(
    run, start: Choices, c: Choices, budget, weights: int, world_size: int, fits: bool = True
) -> dict[str, str]:
    def gib(x: float) -> str:
        return f"{x / GIB:.1f} GiB"

    r = {}
    r["gradient_checkpointing"] = (
        f"train.gradient_checkpointing={run.train.gradient_checkpointing}"
        if run.train.gradient_checkpointing != "auto"
        else "on: activations of every block do not fit"
        if c.gradient_checkpointing
        else "off: activations fit, no recompute cost"
    )
    if run.dist.strategy != "auto":
        r["zero_stage"] = f"dist.strategy={run.dist.strategy}"
    elif c.zero_stage == 3 and budget is not None and weights > budget:
        r["zero_stage"] = (
            f"3: frozen weights {gib(weights)} exceed the {gib(budget)} budget; sharded over {world_size} GPUs"
        )
    else:
        r["zero_stage"] = (
            "3: needed to fit"
            if c.zero_stage == 3
            else "0: plain data parallel fits (ZeRO-1/2 shard nothing useful for LoRA)"
            if fits
            else "0: nothing fits this card set (see the advice)"
        )
    r["loss_chunk_tokens"] = (
        f"{c.loss_chunk_tokens}: the full fp32 logits do not fit" if c.loss_chunk_tokens else "0: reference loss fits"
    )
    r["offload_checkpoints"] = (
        "on: the checkpointed block inputs do not fit; they wait in pinned CPU memory "
        "(two PCIe copies per block and step)"
        if c.offload_checkpoints
        else "off"
    )
    r["mlp_tile_tokens"] = (
        f"train.tiled_mlp={run.train.tiled_mlp}"
        if run.train.tiled_mlp != "auto"
        else f"{c.mlp_tile_tokens}: the MLP's intermediate (tokens x 2 ffn) does not fit; one tile's "
        "does (one more MLP forward per step)"
        if c.mlp_tile_tokens
        else "0: the whole MLP fits"
    )
    r["offload_params"] = (
        "off: DeepSpeed's parameter offload kept the whole model on the card when measured (H100, deepspeed 0.19.8)"
    )
    r["micro_batch_size"] = sequence.batch_reason(start, c)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    allocator = allocator_in_force(conf)
    r["allocator"] = (
        f"{ALLOCATORS[allocator]} (PYTORCH_CUDA_ALLOC_CONF="
        f"{conf if conf is not None else 'unset: glmtune sets expandable_segments:True'})"
        + (
            ""
            if allocator == "expandable"
            else "; its reserve is planned larger (up to 1.21 x at an evaluation after training, measured)"
        )
    )
    r["eval_batch_size"] = (
        "halved until evaluation, with its own allocator reserve, fits"
        if c.eval_batch_size < start.eval_batch_size
        else "train.eval_batch_size"
    )
    if c.sequence_parallel > 1 and (run.data.val_file or run.data.val_size):  # train/sequence.py
        r["eval_batch_size"] += (
            f"; the eval loss is sharded over each group's {c.sequence_parallel} GPUs"
            " like training"
            + (
                "; eval.generate decodes whole rows on every GPU (a KV cache "
                "grows token by token, it is not cut), its cache budgeted at the whole prompt + "
                "eval.max_new_tokens"
                if run.eval.generate
                else ""
            )
        )
    return r
