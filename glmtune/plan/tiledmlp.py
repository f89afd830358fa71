"""Tiled MLP in the plan: the tile size, the estimator's terms for a tiled MLP, and the ladder rung's test.

models/kernels/tiling.py computes a block's MLP `tile` tokens at a time, each tile under a non-reentrant checkpoint.
What that changes in the estimate (estimate.py block_saved / block_working), checked against measured live
tensor bytes on CPU (tests/models/test_tiled_mlp.py):
- kept for backward: only the tiles' input, the block's normed hidden state [tokens, hidden] (the tiles are
  views of it), instead of the fused [gate | up] output, silu's output and the LoRA inputs of both projections;
- backward working set: one tile recomputed (its saved tensors, as the untiled MLP keeps them, for `tile`
  tokens) plus one tile's SwiGLU gradients, and the input gradient assembled from the tiles' parts: the parts,
  then their concatenation, [tokens, hidden] each.

Tile size (bench/tiled_mlp.py, RESULTS.md): TILE_PER_HIDDEN x hidden_size tokens. A tile's fused output is then
2 x ffn x TILE_PER_HIDDEN x hidden x 2 B, a fixed multiple of the dense_h_to_4h weight whatever the length
(GLM-4-9B: 8,192 tokens, 428 MiB), while its matmuls stay [8192, 4096] x [4096, 27392], far above the size
where a GPU's matmul efficiency drops; on CPU no tile size was measurably cheaper than another.
"""

from __future__ import annotations

TILE_PER_HIDDEN = 2


def tile_tokens(arch) -> int:
    """The tile the planner and `train.tiled_mlp=on` use for this architecture, in tokens."""
    return TILE_PER_HIDDEN * arch.hidden_size


def tile_in_force(shape, tokens: int) -> int:
    """The tile size when a block of `tokens` tokens runs tiled, else 0 (a shorter input runs whole)."""
    tile = shape.mlp_tile_tokens
    return tile if 0 < tile < tokens else 0


def saved(e: int, tokens: int, hidden: int, needs_grad: bool) -> int:
    """What a tiled MLP keeps for backward: its input, when anything in or before it needs a gradient."""
    return e * tokens * hidden if needs_grad else 0


def working(e: int, tokens: int, tile: int, ffn: int, hidden: int, tile_saved: int) -> int:
    """A block's backward working set with its MLP tiled: the larger of
    - the MLP's: one recomputed tile's saved tensors (`tile_saved`, the untiled terms at `tile` tokens), its
      SwiGLU gradients (3 x ffn per token, as untiled), the incoming gradient and the input gradient's parts
      plus their concatenation (3 x [tokens, hidden]);
    - post_attention_layernorm's backward after it, which untiled never shows: the incoming and the MLP's input
      gradient plus ~4 fp32 [tokens, hidden] (the norm's fp32 arithmetic), less the MLP's kept input, freed by
      then (fitted on CPU, fp32 and bf16, 1,024 tokens: tests/models/test_tiled_mlp.py)."""
    return max(tile_saved + 3 * e * tile * ffn + 3 * e * tokens * hidden, (e + 16) * tokens * hidden)


def helps(shape, tokens: int, tile: int) -> bool:
    """The rung changes something: tiling is off and a micro-batch has more tokens than a tile."""
    return shape.mlp_tile_tokens == 0 and tokens > tile
