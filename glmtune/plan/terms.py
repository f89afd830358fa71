"""The tensor terms of the estimate: what one GLM block, its MLP and the loss head keep for backward and use while
they run, and the LoRA parameters they train.

They follow what glmtune's own model (models/chatglm/, on models/kernels/) keeps for backward, counted per
storage: RMSNorm keeps its input and (bf16/fp16) an fp32 copy; SDPA keeps q, the GQA-expanded K and V
(expand+reshape copies to all heads), its output and an fp32 log-sum-exp; SwiGLU keeps the fused
h_to_4h output (silu and the product reference it) and silu's output; frozen Linears keep nothing,
a LoRA-wrapped one keeps its (dropped-out) input, the dropout mask and lora_A's output. Reentrant
checkpointing keeps one [tokens, hidden] input per block and recomputes one block in backward. The
reference loss keeps fp32 logits, a shifted contiguous copy and log_softmax's output at once
(14 B/token/vocab in bf16, 12 in fp32); the chunked loss holds that for `loss_chunk_tokens` only.
These are checked against measured live tensor bytes on CPU (tests/plan/test_memory.py, bench/). `shape` is the
estimator's RunShape (estimate.py).
"""

from __future__ import annotations

from ..models import GLMConfig
from . import quantized, tiledmlp, variants
from .variants import BYTES, HEADS, linear_shapes, peft_adapter_dtype, roles


def lora_params(arch: GLMConfig, shape) -> int:
    shapes = linear_shapes(arch)
    per = sum(shape.lora_r * (shapes[t][0] + shapes[t][1]) for t in shape.lora_targets if t not in HEADS)
    head = sum(shape.lora_r * sum(shapes[t]) for t in shape.lora_targets if t in HEADS)
    return arch.num_layers * per + head


def _lora_saved(tokens: int, d_in: int, shape, a: int) -> int:
    """Bytes a LoRA branch keeps: lora_A's input (dropped-out copy, or the input itself), the dropout
    mask (bool on CUDA, a full-dtype noise tensor on CPU) and lora_A's [tokens, r] output. peft casts the
    input to the adapters' dtype before dropout; under autocast the matmul then saves a compute-dtype copy
    (measured on an H100: all four targets at 512 tokens keep 0.98 GiB less than fp32 inputs would)."""
    mask = 0 if shape.lora_dropout == 0 else (a if shape.device == "cpu" else 1)
    saved = BYTES[shape.dtype] if shape.autocast else a
    return tokens * d_in * (saved + mask) + tokens * shape.lora_r * saved


def _lora_inputs(tokens: int, d_in: int, layers: int, shape, a: int) -> int:
    """`layers` LoRA branches on one input (GLM-4-0414's q, k and v_proj): each keeps its own dropped-out (or
    cast) copy, except without dropout in the adapters' own dtype, where all keep the input itself."""
    one = _lora_saved(tokens, d_in, shape, a)
    if shape.lora_dropout == 0 and not shape.autocast and BYTES[shape.dtype] == a:
        return one + (layers - 1) * tokens * shape.lora_r * a
    return layers * one


def block_saved(arch: GLMConfig, shape, tokens: int, input_requires_grad: bool) -> int:
    """Bytes one GLMBlock keeps for backward (no checkpointing inside it)."""
    e, a = BYTES[shape.dtype], BYTES[shape.adapter_dtype or peft_adapter_dtype(shape.dtype)]
    h, heads, g, d = (
        arch.hidden_size,
        arch.num_attention_heads,
        arch.kv_groups,
        arch.kv_channels,
    )
    fp32_copy = 4 * tokens * h if e != 4 else 0  # RMSNorm's x.to(float32), kept by pow
    norm = e * tokens * h + fp32_copy  # an RMSNorm's input (kept by the mul) + its fp32 copy
    sandwich = getattr(arch, "norms_per_layer", 2) > 2  # GLM-4-0414: a norm after attention and after the MLP
    targets = roles(shape.lora_targets)
    qkv = sum(t in ("query_key_value", "q_proj", "k_proj", "v_proj") for t in shape.lora_targets)
    rg, total = input_requires_grad, 0
    if rg:
        total += norm  # input_layernorm
    if qkv:
        total += _lora_inputs(tokens, h, qkv, shape, a)
        rg = True
    if rg:  # attention: q after rotary, K and V expanded to all heads, output, fp32 log-sum-exp
        kv = 2 * e * tokens * heads * d if g != heads else e * tokens * (arch.qkv_out + g * d)
        total += 2 * e * tokens * heads * d + kv + 4 * tokens * heads
    if "dense" in targets:
        total += _lora_saved(tokens, heads * d, shape, a)
        rg = True
    if rg:  # post_attention_layernorm on the residual sum (and GLM-4-0414's post_self_attn_layernorm before it)
        total += norm * (2 if sandwich else 1)
    mlp_rg = rg or bool(targets & {"dense_h_to_4h", "dense_4h_to_h"})
    if tiledmlp.tile_in_force(shape, tokens):  # the tiles keep their input; the rest is recomputed per tile
        total += tiledmlp.saved(e, tokens, h, mlp_rg)
    else:
        total += mlp_saved(arch, shape, tokens, rg)
    if sandwich and mlp_rg:  # post_mlp_layernorm on the MLP's output
        total += norm
    return (
        total
        + quantized.saved_bytes(arch, shape.quantize, e, tokens)
        + variants.dora_saved(arch, shape, tokens, input_requires_grad)
    )


def mlp_saved(arch: GLMConfig, shape, tokens: int, rg: bool) -> int:
    """Bytes the untiled MLP keeps for backward (rg: its input needs grad)."""
    e, a, f = BYTES[shape.dtype], BYTES[shape.adapter_dtype or peft_adapter_dtype(shape.dtype)], arch.ffn_hidden_size
    total, targets = 0, roles(shape.lora_targets)
    if "dense_h_to_4h" in targets:
        total += _lora_saved(tokens, arch.hidden_size, shape, a)
        rg = True
    if rg:  # SwiGLU: fused [gate|up] output and silu(gate)
        total += 3 * e * tokens * f
    if "dense_4h_to_h" in targets:
        total += _lora_saved(tokens, f, shape, a)
    return total


def block_working(arch: GLMConfig, shape, tokens: int) -> int:
    """Transient bytes on top of the saved ones while one block runs backward (or forward without grad):
    the SwiGLU gradients (the fused [tokens, 2f] and one [tokens, f] at a time) and two [tokens, h].
    Fitted on an H100 at 8K-32K tokens with checkpointing (bench/RESULTS.md): 4f + 3h over-counted ~50 KB per
    token, the SwiGLU input's storage being freed before the fused gradient is built."""
    e, quant = (
        BYTES[shape.dtype],
        quantized.working_bytes(
            arch, shape.quantize, BYTES[shape.dtype], tokens, shape.device != "cpu", shape.double_quant
        ),
    )
    f, h, tile = arch.ffn_hidden_size, arch.hidden_size, tiledmlp.tile_in_force(shape, tokens)
    mlp = (
        tiledmlp.working(e, tokens, tile, f, h, mlp_saved(arch, shape, tile, True))
        if tile
        else e * tokens * (3 * f + 2 * h)
    )
    return mlp + quant + variants.dora_working(arch, shape, tokens)


def loss_bytes(arch: GLMConfig, shape, tokens: int) -> int:
    """Peak of the loss head. Reference: fp32 logits + shifted contiguous copy + log_softmax output
    (+ the bf16/fp16 logits returned) in forward, log_softmax output + two fp32 gradients in backward:
    12 B per token and vocab entry, 14 in bf16/fp16 with micro-batch > 1 (for one sample the shift is a
    view, no copy). Chunked: 12 B per chunk token and vocab entry (measured on CPU)."""
    e, v = BYTES[shape.dtype], arch.padded_vocab_size
    if shape.loss_chunk_tokens > 0:
        return 12 * min(tokens, shape.loss_chunk_tokens) * v + 2 * e * tokens * arch.hidden_size
    return (12 + (e if e != 4 and shape.micro_batch > 1 else 0)) * tokens * v


def eval_loss_bytes(arch: GLMConfig, shape, tokens: int) -> int:
    """Loss head without grad: the 16-bit logits die when rebound to fp32, nothing is kept for backward.
    Reference: fp32 logits + shifted copy + log_softmax = 12 B per token and vocab entry. Chunked: one
    chunk's head output, its fp32 copy and log_softmax."""
    v = arch.padded_vocab_size
    if shape.loss_chunk_tokens > 0:
        return (BYTES[shape.dtype] + 8) * min(tokens, shape.loss_chunk_tokens) * v
    return 12 * tokens * v
