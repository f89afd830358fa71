"""Estimator terms of the LoRA variants and optimizers beyond plain LoRA with torch AdamW.

DoRA (peft 0.11.1, `LoraLayer._apply_dora`), per adapted Linear of shape [out, in] and T tokens:
- a trainable magnitude vector of `out` fp32 entries (weights, grads and Adam states like any adapter);
- kept for backward: the extra base matmul's output F.linear(x, W) and the scaled LoRA output, both [T, out]
  (the magnitude multiplies them), and, when x requires grad, the weight copy that matmul was given (peft casts
  W to x's dtype, the adapters' fp32, a new tensor when the base is bf16; under autocast a bf16 copy again);
- a transient while the weight norm is computed: B @ A, its scaled copy and W + that, each [out, in], plus the
  fp32 copy of W when it was not kept. On GLM-4-9B's query_key_value that is 4608 x 4096 x 4 B = 75 MB each.
rsLoRA changes only the scaling (alpha / sqrt(r)): no term.

bitsandbytes' AdamW8bit (0.50): tensors of at least 4,096 elements keep m and v as uint8 (2 B per parameter)
plus one fp32 absmax per 256-element block for each (8 B per 256), and two shared 256-entry fp32 code tables;
smaller tensors keep fp32 m and v (8 B per parameter), as torch AdamW does.
"""

from __future__ import annotations

import math

from ..config import LORA_TARGETS
from ..models import GLMConfig

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size default: smaller tensors get 32-bit states
BNB_BLOCK = 256  # elements per absmax block of the blockwise 8-bit states
BNB_QMAPS = 2 * 256 * 4  # the dynamic code tables for m and v, one copy per optimizer
# GLM-4-0414's Linears by the ChatGLM layer whose place they take (q/k/v_proj split query_key_value).
ROLE = {
    "q_proj": "query_key_value",
    "k_proj": "query_key_value",
    "v_proj": "query_key_value",
    "o_proj": "dense",
    "gate_up_proj": "dense_h_to_4h",
    "down_proj": "dense_4h_to_h",
    "lm_head": "output_layer",
}
HEADS = ("output_layer", "lm_head")  # the one LM head, not one per layer
# As a GLM block runs them (config.LORA_TARGETS lists them in that order): the ChatGLM names, then GLM-4-0414's.
_ORDER = tuple(t for t in LORA_TARGETS if t not in HEADS)


def linear_shapes(arch: GLMConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-targetable linear, by official module name (both families' names)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.kv_channels, arch.kv_groups * arch.kv_channels
    return {
        "query_key_value": (h, arch.qkv_out),
        "dense": (q, h),
        "dense_h_to_4h": (h, 2 * f),
        "dense_4h_to_h": (f, h),
        "output_layer": (h, arch.padded_vocab_size),
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_up_proj": (h, 2 * f),
        "down_proj": (f, h),
        "lm_head": (h, arch.padded_vocab_size),
    }


def roles(targets) -> set[str]:
    """The ChatGLM layer each target sits in (its own name for the ChatGLM family)."""
    return {ROLE.get(t, t) for t in targets}


def peft_adapter_dtype(dtype: str) -> str:
    """glmtune.train.lora.apply_lora always keeps adapters in fp32, whatever the base dtype and peft version."""
    return "fp32"


def _adapted(arch: GLMConfig, shape) -> list[tuple[str, int, int]]:
    """(target, out, in) for every adapted Linear of one block, in the order the block runs them."""
    shapes = linear_shapes(arch)
    return [(t, shapes[t][1], shapes[t][0]) for t in _ORDER if t in shape.lora_targets]


def lora_tensor_sizes(arch: GLMConfig, shape) -> list[int]:
    """Element counts of every trainable tensor: lora_A [r, in] and lora_B [out, r] per adapted Linear, and
    DoRA's magnitude [out]."""
    shapes, sizes = linear_shapes(arch), []
    for target in shape.lora_targets:
        d_in, d_out = shapes[target]
        layers = 1 if target in HEADS else arch.num_layers
        sizes += [shape.lora_r * d_in, d_out * shape.lora_r] * layers
        sizes += [d_out] * layers if getattr(shape, "use_dora", False) else []
    return sizes


def dora_params(arch: GLMConfig, shape) -> int:
    if not getattr(shape, "use_dora", False):
        return 0
    return sum(linear_shapes(arch)[t][1] * (1 if t in HEADS else arch.num_layers) for t in shape.lora_targets)


def optimizer_state_bytes(arch: GLMConfig, shape, adapter_bytes: int) -> int:
    """Adam's m and v for every trainable tensor (adapter_bytes: 4 for the fp32 adapters)."""
    sizes = lora_tensor_sizes(arch, shape)
    if getattr(shape, "optimizer", "adamw_torch") != "adamw_8bit":
        return 2 * adapter_bytes * sum(sizes)
    small = sum(n for n in sizes if n < BNB_MIN_8BIT_SIZE)
    large = [n for n in sizes if n >= BNB_MIN_8BIT_SIZE]
    blocks = sum(math.ceil(n / BNB_BLOCK) for n in large)
    return 8 * small + 2 * sum(large) + 8 * blocks + (BNB_QMAPS if large else 0)


def _dtypes(shape) -> tuple[int, int]:
    e, a = BYTES[shape.dtype], BYTES[shape.adapter_dtype or peft_adapter_dtype(shape.dtype)]
    return e, (e if shape.autocast else a)  # compute-dtype bytes, bytes of DoRA's matmul inputs and outputs


def dora_saved(arch: GLMConfig, shape, tokens: int, input_requires_grad: bool) -> int:
    """Bytes DoRA adds to what one block keeps for backward."""
    if not getattr(shape, "use_dora", False):
        return 0
    e, m = _dtypes(shape)
    total, rg = 0, input_requires_grad
    for _, d_out, d_in in _adapted(arch, shape):
        total += 2 * tokens * d_out * m
        if rg and (m != e or shape.autocast):  # a new weight tensor was made for the matmul: it is kept
            total += d_out * d_in * m
        rg = True  # every later input depends on an adapter's output
    return total


def dora_last_saved(arch: GLMConfig, shape, tokens: int) -> int:
    """What dora_saved holds for a block's last Linear (dense_4h_to_h / down_proj when adapted): in a recomputed
    block its backward runs first and frees these before the block's backward peak (fitted on the CPU grid)."""
    if not getattr(shape, "use_dora", False) or "dense_4h_to_h" not in roles(shape.lora_targets):
        return 0
    e, m = _dtypes(shape)
    d_in, d_out = arch.ffn_hidden_size, arch.hidden_size
    return 2 * tokens * d_out * m + (d_out * d_in * m if m != e or shape.autocast else 0)


def dora_working(arch: GLMConfig, shape, tokens: int) -> int:
    """The weight-norm temporaries of the largest adapted Linear (one layer at a time)."""
    if not getattr(shape, "use_dora", False):
        return 0
    e, m = _dtypes(shape)
    a = 4 if m != e or not shape.autocast else m
    # B @ A and W + scaling * (B @ A) are live together (the scaled copy dies inside the add on the CPU grid),
    # plus the fp32 copy of a 16-bit W.
    return max((d_out * d_in * (2 * a + (a if a != e else 0)) for _, d_out, d_in in _adapted(arch, shape)), default=0)
