"""Tiled MLP: the SwiGLU MLP of a GLM block computed in token tiles, each tile under its own checkpoint.

GLM's MLP widens every token to the fused [gate | up] output, 2 x ffn wide (27,392 for GLM-4-9B: 54,784 B per
token in bf16, 1.7 GiB per block at 32K tokens), and silu(gate) * up adds two more [tokens, ffn]. Untiled,
a block keeps these for backward (or, under block checkpointing, the recomputed block does), and the fused
gradient is as large again: at long lengths the MLP intermediate is the largest tensor of a step.

Tiled, the block's tokens (batch x sequence, flattened) are split into tiles of `tile_tokens`; each tile runs
the whole MLP under a non-reentrant checkpoint that keeps only its input (a view of the block's normed
hidden state, no new bytes) and recomputes the tile in backward. So one tile's [tile, 2 x ffn] exists at a
time, in forward and in backward, whatever the length. The price is one more MLP forward per step (bench/
tiled_mlp.py measures it). Without grad (the first pass of reentrant block checkpointing, evaluation) the
tiles just run one after the other.

Non-reentrant inside the block composes with the block's own checkpointing, reentrant or not: under reentrant
checkpointing the block's recompute runs the tiles with grad and the block's backward recomputes each tile
once more; it needs no input to require grad (LoRA on the MLP alone still gets its gradients), and it works
with peft's LoRA layers and with ZeRO-3's per-module parameter gathering (tests/test_tiled_mlp.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


def tiled(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """mlp(x) for x [..., hidden], computed `tile_tokens` tokens at a time (the leading dims flattened)."""
    flat = x.reshape(-1, x.shape[-1])
    tiles = flat.split(tile_tokens)  # one SplitBackward: the input's gradient is assembled once, not per tile
    if torch.is_grad_enabled():
        # Early stop off, as for the blocks (layers.no_early_stop says why): the reentrant block checkpoint
        # recomputes this forward inside backward, outside the encoder's own no_early_stop() context.
        with set_checkpoint_early_stop(False):
            outs = [checkpoint(mlp, tile, use_reentrant=False) for tile in tiles]
    else:
        outs = [mlp(tile) for tile in tiles]
    return torch.cat(outs).view(*x.shape[:-1], outs[0].shape[-1])


def set_mlp_tile_tokens(model: torch.nn.Module, tile_tokens: int) -> int:
    """Tile every GLM MLP of `model` (a peft wrapper too) at `tile_tokens` tokens (0 = off); returns how many
    MLPs took it (0 for a checkpoint's own remote code, which has no tiled path)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "mlp_tile_tokens"):
            module.mlp_tile_tokens = tile_tokens
            count += 1
    return count
