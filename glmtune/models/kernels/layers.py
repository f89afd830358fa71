"""The pieces of a GLM decoder that every family computes alike: RMSNorm, GLM's interleaved partial rotary
embedding, the SwiGLU MLP's tiled forward, and the loop over the decoder blocks with checkpointing and
checkpoint offload. A family (models/chatglm, models/glm4_0414) puts them under its own module names.

Both families rotate adjacent pairs (x[2i], x[2i+1]) of the first `dim` dims of each head with frequency
base^(-2i/dim): ChatGLM's `rotary_pos_emb` (dim = kv_channels / 2, base 10000 * rope_ratio) and transformers'
GLM `apply_rotary_pos_emb` ("interleave them": cos[..., :d/2].repeat_interleave(2); dim = head_dim x
partial_rotary_factor, base rope_theta) are the same map.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from .tiling import tiled


class RMSNorm(nn.Module):
    """RMS norm with the variance in fp32. `weight_last`: ChatGLM multiplies the fp32 normalised input by the
    weight and casts the product (weight_last=False); transformers' Glm4RMSNorm casts to the input dtype first
    and multiplies after (True). In fp32 the two are the same; in bf16 each is its reference's rounding."""

    def __init__(self, dim: int, eps: float, weight_last: bool = False):
        super().__init__()
        self.eps, self.weight_last = eps, weight_last
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (float64 inputs, used by the tests, keep float64.)
        variance = x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.eps)
        if self.weight_last:
            return self.weight * normed.to(x.dtype)
        return (self.weight * normed).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin table for the rotated part of each head: `dim` dims (64 of 128 in the released GLM models)."""

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.dim, self.base = dim, base
        # Kept for checkpoint compatibility only (ChatGLM's merged checkpoints carry it, as the official ones do).
        # It is created on whatever device the model is built on (a `torch.device` context, meta, DeepSpeed's
        # zero.Init) and never read in forward: the frequencies are recomputed in fp32 on the positions'
        # device, so a bf16 cast cannot degrade them and a buffer left on another device cannot break a step
        # (it stayed on the CPU under ZeRO-3 on a GPU: "Expected all tensors to be on the same device").
        self.register_buffer("inv_freq", self._theta(None), persistent=False)

    def _theta(self, device: torch.device | None) -> torch.Tensor:
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return 1.0 / (self.base**exponent)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """position_ids [B, S] -> [B, S, dim/2, 2] with (cos, sin) in the last axis."""
        angles = position_ids[..., None].to(torch.float32) * self._theta(position_ids.device)
        cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        return cache.to(dtype) if dtype in (torch.float16, torch.bfloat16) else cache


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first 2*rope.shape[-2] dims; pass the rest through."""
    b, h, s, _ = x.shape
    rot = rope.shape[-2] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    pairs = x_rot.reshape(b, h, s, rot // 2, 2)
    rope = rope.view(rope.shape[0], 1, s, rot // 2, 2)
    out = torch.stack(
        [
            pairs[..., 0] * rope[..., 0] - pairs[..., 1] * rope[..., 1],
            pairs[..., 1] * rope[..., 0] + pairs[..., 0] * rope[..., 1],
        ],
        dim=-1,
    ).flatten(3)
    return torch.cat([out, x_pass], dim=-1)


class TiledMLP(nn.Module):
    """GLM's SwiGLU MLP, down(silu(gate) * up) with [gate | up] fused in one projection, run in token tiles when
    the plan says so. A family gives its two projections under its checkpoint's names (`projections`)."""

    # Set by models.kernels.tiling.set_mlp_tile_tokens from the plan: above this many tokens (batch x sequence)
    # the MLP runs in tiles of it, one tile's [tile, 2 x ffn] intermediate live at a time (0 = never tiled);
    # under ZeRO-3 the tiles' checkpoints are reentrant (models/kernels/tiling.py says why).
    mlp_tile_tokens, mlp_tile_zero3 = 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < self.mlp_tile_tokens < x.numel() // x.shape[-1]:
            zero3 = (
                [p for p in self.parameters() if p.requires_grad and hasattr(p, "ds_id")]
                if self.mlp_tile_zero3
                else None
            )
            return tiled(self.swiglu, x, self.mlp_tile_tokens, zero3)
        return self.swiglu(x)

    def projections(self) -> tuple[nn.Module, nn.Module]:
        """(the fused [gate | up] projection, 2 x ffn wide with the gate rows first; the down projection)."""
        raise NotImplementedError

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.projections()
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up)


def no_early_stop():
    """Non-reentrant checkpoints recompute their whole function in backward. By default they stop as soon as
    the last saved tensor is rebuilt, by raising an exception from the saved-tensor hook, i.e. from inside a
    C++ op; on CUDA with the allocator's history recording on (the run's OOM snapshot, probe/diagnose.py) that
    exception was lost while the op's temporaries were freed, and backward died with `SystemError: <built-in
    function cross_entropy_loss> returned NULL without setting an exception` (bench/ckpt_early_stop.py).
    Without early stop nothing is raised; the price is the ops after the last saved tensor (none in a loss
    chunk, the block's last projection in a GLM block). Read when the forward runs; reentrant ones ignore it."""
    return set_checkpoint_early_stop(False)


def run_layers(stack: nn.Module, layers, hidden, mask, rope, kv_caches, use_cache):
    """The decoder blocks in turn: (hidden, the new KV caches or None). `stack` is the module that carries
    `gradient_checkpointing` and `_gradient_checkpointing_func` (set by PreTrainedModel.gradient_checkpointing_
    enable) and `offload_checkpoints` (set by the trainer from the plan: the inputs that reentrant checkpointing
    keeps for every block, tokens x hidden x 2 B each, 2.5 GiB for 40 blocks at 8K, wait in pinned CPU memory
    until backward). Each layer takes (hidden, mask, rope, cache, use_cache) and returns (hidden, cache)."""
    presents = [] if use_cache else None
    ckpt = stack.gradient_checkpointing and stack.training
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=hidden.is_cuda)
        if ckpt and stack.offload_checkpoints and torch.is_grad_enabled()
        else contextlib.nullcontext()
    )
    with offload, no_early_stop():
        for i, layer in enumerate(layers):
            cache = kv_caches[i] if kv_caches is not None else None
            if ckpt:
                hidden, present = stack._gradient_checkpointing_func(
                    layer.__call__, hidden, mask, rope, cache, use_cache
                )
            else:
                hidden, present = layer(hidden, mask, rope, cache, use_cache)
            if use_cache:
                presents.append(present)
    return hidden, presents


def set_offload_checkpoints(model: nn.Module, offload: bool) -> int:
    """Turn checkpoint offload (run_layers) on or off in every decoder stack of `model` (a peft wrapper too);
    returns how many stacks took it (0 for a checkpoint's own remote code)."""
    stacks = [m for m in model.modules() if hasattr(m, "offload_checkpoints")]
    for stack in stacks:
        stack.offload_checkpoints = offload
    return len(stacks)
