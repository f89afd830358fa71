"""The caching allocator's reserve: what a GPU process holds beyond its live tensors, phase by phase.

Each phase (the training step's loss and backward, GLM-4V's vision tower, evaluation, generation) has its own
largest transient tensor, and the reserve over that phase's allocated peak grows with it: a freed block of
that size is rarely the exact size asked for next. A phase's whole footprint is its tensors plus its own
reserve; the plan's peak is the largest footprint, so an evaluation with a 7 GB SwiGLU output is charged for
it even when the training step's transients are small.

Two allocators, fitted on the H100 rows of bench/gpu_calib_2026-11-23.jsonl (torch 2.11, 2026-11-23):
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, glmtune's default): reserved minus
  allocated was 0.09-0.81 GiB over 15 rows, within RESERVE_FLOOR + RESERVE_PER_LARGEST x the largest transient.
- the default allocator (the variable set without expandable segments): 1.07 GiB over a 1.16 GiB largest
  transient (2,048 tokens) and 3.70 over 4.62 GiB (8,192 tokens, checkpointing): DEFAULT_PER_LARGEST covers
  both. An evaluation after training did not reuse the training's cached blocks: at 500 tokens and eval batch
  4 the reserve grew from 22.54 to 26.49 GiB (1.21 x the training's allocated peak), the evaluation's own
  tensors on top of the training's cache. So an evaluation or generation phase is charged the training's
  whole footprint plus its own activations and reserve.
- an evaluation after training with expandable segments (the CLI path: training steps, an evaluation, training
  again). On an H200 (bench/gpu_cli.py, RESULTS §11) the whole process grew during the first evaluation by
  +0.74 GiB at 4K tokens with eval batch 4 and +1.41 GiB at ~24.7K with eval batch 4, and by nothing at eval
  batch 2 and on short rows; the H100 grid's evaluations after training (gpu_calib_2026-11-23) grew by 0-0.14.
  It grew when the evaluation's SwiGLU outputs [eval tokens, 2f] outgrew every transient the training had
  freed, and far slower than in proportion: EVAL_CARRY x (sqrt(SwiGLU x 1 GiB) - sqrt(training's largest x
  1 GiB)), fitted on the 4K row (the tightest); +1.7 % over on the ~24.7K row, +2.5 % at 4K eval batch 2, and
  0 on every row that did not grow. An evaluation is then charged the training's whole footprint plus that.
"""

from __future__ import annotations

import math

from ..config.units import GIB, MIB
from ..models import GLMConfig
from .longctx import local_tokens

RESERVE_FLOOR = 256 * MIB
RESERVE_PER_LARGEST = 0.55
DEFAULT_PER_LARGEST = 0.9
EVAL_CARRY = 1.62  # growth of an evaluation after training, per sqrt(GiB) of SwiGLU beyond the training's largest
TRAINING_PHASES = ("loss", "backward", "vision")
ALLOCATORS = {"expandable": "expandable segments", "default": "the default caching allocator"}


def allocator_in_force(conf: str | None) -> str:
    """'expandable' or 'default', from PYTORCH_CUDA_ALLOC_CONF as the training process will see it: unset,
    glmtune's entry point sets expandable segments before torch starts; a value the user set is kept as it is,
    and only `expandable_segments:True` among its comma-separated options turns them on."""
    if conf is None:
        return "expandable"
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return "expandable" if options.get("expandable_segments", "").lower() == "true" else "default"


def largest_transients(arch: GLMConfig, shape, e: int) -> dict[str, int]:
    """Per phase, the largest single tensor it allocates and frees: fp32 logits (of a loss chunk or of the
    whole batch), the fused SwiGLU output [tokens, 2f], in the vision tower one ViT layer's widest output, or in
    generation the prefill's SwiGLU output and the
    last position's fp32 logits (the model returns only those while generating)."""
    v, two_f = arch.padded_vocab_size, 2 * arch.ffn_hidden_size
    tile = getattr(shape, "mlp_tile_tokens", 0)  # a tiled MLP (models/kernels/tiling.py) widens one tile at a time

    def wide(tokens: int) -> int:
        """The SwiGLU output; tiled, one tile's, or the norms' fp32 [tokens, hidden] once that is larger."""
        if not tile or tokens <= tile:
            return e * tokens * two_f
        return max(e * tile * two_f, 4 * tokens * arch.hidden_size)

    def step(tokens: int) -> int:
        chunk = shape.loss_chunk_tokens or tokens
        return max(4 * min(tokens, chunk) * v, wide(tokens))

    tokens = local_tokens(shape)  # this rank's shard under sequence parallelism; evaluation sees whole rows
    out = {"loss": step(tokens), "backward": step(tokens)}
    if arch.vision_config:  # the ViT's QKV [T, 3w] or fc1 output [T, i], T = patches + CLS of every image
        vc = arch.vision_config
        patches = (
            shape.micro_batch * max(shape.images_per_sample, 1) * ((vc["image_size"] // vc["patch_size"]) ** 2 + 1)
        )
        out["vision"] = e * patches * max(3 * vc["hidden_size"], vc["intermediate_size"])
    if shape.eval_batch:
        et = shape.eval_batch * shape.seq_len
        out["eval"] = step(et)
        out["eval swiglu"] = wide(et)  # what the training's freed blocks could not hold (module docstring)
        out["generate"] = max(wide(et), 4 * shape.eval_batch * v)
    return out


def phase_reserves(arch: GLMConfig, shape, e: int, phases: dict[str, int], states: int) -> dict[str, int]:
    """Bytes each phase's allocator holds beyond that phase's tensors (`phases`); `states` are the model states
    every phase holds (weights, adapters, optimizer)."""
    largest = largest_transients(arch, shape, e)
    if shape.allocator == "expandable":
        reserves = {p: RESERVE_FLOOR + int(RESERVE_PER_LARGEST * largest[p]) for p in phases}
        training = [p for p in phases if p in TRAINING_PHASES]
        if "eval" in phases and training:  # the evaluation runs on the cache the training steps left
            top = max(training, key=lambda p: phases[p] + reserves[p])
            growth = EVAL_CARRY * (math.sqrt(largest["eval swiglu"] * GIB) - math.sqrt(largest[top] * GIB))
            if growth > 0:
                reserves["eval"] = max(reserves["eval"], phases[top] + reserves[top] + int(growth) - phases["eval"])
        return reserves
    reserves = {p: RESERVE_FLOOR + int(DEFAULT_PER_LARGEST * largest[p]) for p in phases}
    training = max(phases[p] + reserves[p] for p in phases if p in TRAINING_PHASES)
    for p in phases:
        if p not in TRAINING_PHASES:  # the training's cache stays; this phase's activations come on top
            reserves[p] += training - states
    return reserves
