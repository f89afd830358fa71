"""Tiled MLP: the SwiGLU MLP of a GLM block computed in token tiles, each tile under its own checkpoint.

GLM's MLP widens every token to the fused [gate | up] output, 2 x ffn wide (27,392 for GLM-4-9B: 54,784 B per
token in bf16, 1.7 GiB per block at 32K tokens), and silu(gate) * up adds two more [tokens, ffn]. Untiled,
a block keeps these for backward (or, under block checkpointing, the recomputed block does), and the fused
gradient is as large again: at long lengths the MLP intermediate is the largest tensor of a step.

Tiled, the block's tokens (batch x sequence, flattened) are split into tiles of `tile_tokens`; each tile runs
the whole MLP under a checkpoint that keeps only its input (a view of the block's normed hidden state, no new
bytes) and recomputes the tile in backward. So one tile's [tile, 2 x ffn] exists at a time, in forward and in
backward, whatever the length. The price is one more MLP forward per step (bench/tiled_mlp.py measures it).
Without grad (the first pass of reentrant block checkpointing, evaluation) the tiles just run in turn.

Which checkpoint (tests/models/test_tiled_mlp.py runs each case on CPU, nested in the blocks' reentrant or
non-reentrant checkpointing, with peft LoRA on both projections):
- non-reentrant, the default: the tiles are one autograd graph, so each adapter's gradient is accumulated
  once per backward, which DDP's reducer requires (a parameter marked ready twice is an error), and no input
  needs to require grad. Under ZeRO-3 it fails: the tile recomputed inside backward runs the projections'
  forward again, whose post-forward hook releases the gathered weight the backward op then reads (measured in
  the first step on 2 CPU ranks: "The size of tensor a (0) must match the size of tensor b (8)").
- reentrant, under ZeRO-3: each tile runs its own backward on its recomputed graph, whose pre-backward hooks
  gather the weights again, as the blocks' reentrant checkpoints do. Each tile then adds to the adapters'
  gradients; ZeRO-3 would put a parameter in its reduce bucket once per tile (its assertion: a parameter
  twice in a bucket), so all but the last tile's backward clear DeepSpeed's `ds_grad_is_ready` flag, which
  stage 3 reads before bucketing a gradient.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


def tiled(
    mlp: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile_tokens: int,
    zero3_params: Sequence[torch.nn.Parameter] | None = None,
) -> torch.Tensor:
    """mlp(x) for x [..., hidden], computed `tile_tokens` tokens at a time (the leading dims flattened).
    zero3_params: None = non-reentrant tiles; else reentrant ones, and the MLP's trainable ZeRO-3 parameters
    whose gradient DeepSpeed must take only after the last tile's backward."""
    flat = x.reshape(-1, x.shape[-1])
    if not torch.is_grad_enabled():
        outs = [mlp(tile) for tile in flat.split(tile_tokens)]
    elif zero3_params is None:
        # Early stop off, as for the blocks (layers.no_early_stop says why): the reentrant block checkpoint
        # recomputes this forward inside backward, outside the encoder's own no_early_stop() context.
        with set_checkpoint_early_stop(False):
            outs = [checkpoint(mlp, tile, use_reentrant=False) for tile in flat.split(tile_tokens)]
    else:
        if not flat.requires_grad:  # reentrant checkpoints back-propagate only from inputs that need grad;
            flat = flat.detach().requires_grad_()  # nothing before x does, so its own gradient is dropped
        tiles = flat.split(tile_tokens)
        run = _last_tile_ready(mlp, zero3_params, len(tiles))
        outs = [checkpoint(run, tile, use_reentrant=True) for tile in tiles]
    return torch.cat(outs).view(*x.shape[:-1], outs[0].shape[-1])


def _last_tile_ready(mlp, params: Sequence[torch.nn.Parameter], tiles: int):
    """mlp, counting its recomputations in backward (grad on: a reentrant tile's forward runs without): the tile
    recomputed last is the last to add to the gradients, and only then may ZeRO-3 reduce them."""
    left = [tiles]

    def run(tile: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            left[0] -= 1
            for p in params:
                p.ds_grad_is_ready = left[0] == 0
        return mlp(tile)

    return run


def set_mlp_tile_tokens(model: torch.nn.Module, tile_tokens: int, zero3: bool = False) -> int:
    """Tile every GLM MLP of `model` (a peft wrapper too) at `tile_tokens` tokens (0 = off); zero3: the model
    runs under DeepSpeed ZeRO-3 (reentrant tiles). Returns how many MLPs took it (0 for a checkpoint's own
    remote code, which has no tiled path)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "mlp_tile_tokens"):
            module.mlp_tile_tokens, module.mlp_tile_zero3 = tile_tokens, zero3
            count += 1
    return count
