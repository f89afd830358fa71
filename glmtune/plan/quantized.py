"""Memory of bitsandbytes base weights (model.quantize=nf4|int8), for the estimator and the planner's advice.

What glmtune.models.quantize stores per Linear of the GLM blocks, n = in x out weights (bitsandbytes 0.50):
- NF4: n/2 B of packed 4-bit codes; one absmax per 64-element block (fp32, 4 B), or with double quantization
  one uint8 per block plus one fp32 per 256 blocks, a 256-entry fp32 code table (1 KiB) and an fp32 offset;
  the 16-entry NF4 code table (64 B). About 0.53 B/param with double quantization, 0.56 without.
- int8: n B of int8 weights plus an fp32 scale per output row.
Everything else (embedding, output_layer, norms, biases, GLM-4V's vision tower) stays in the compute dtype.

Working memory that bf16 weights do not need (the CUDA kernels of bitsandbytes 0.50):
- one dequantized weight in the compute dtype while a quantized Linear runs (NF4 forward and backward,
  int8 backward): the largest is dense_h_to_4h, 4096 x 27392 x 2 B = 224 MB on GLM-4-9B, plus, with double
  quantization, its fp32 absmax (n/64 x 4 B);
- int8 only: the forward quantizes its input (an fp16 copy and an int8 copy, [tokens, in]) and multiplies
  into int32 ([tokens, out] x 4 B) before scaling back; and every int8 Linear whose input needs a gradient
  keeps that input for backward (MatMul8bitLt saves A), which bf16 frozen Linears do not.
"""

from __future__ import annotations

from ..models import GLMConfig

NF4_BLOCK = 64  # weights per absmax: bitsandbytes' default blocksize, CUDA and CPU
NESTED_BLOCK = 256  # absmax values per fp32 scale under double quantization
NF4_CODE = 16 * 4  # the NF4 code table, fp32, kept per layer
NESTED_CODE = 256 * 4 + 4  # double quantization: 8-bit dynamic code table + the fp32 offset, per layer


def quantized_linears(arch: GLMConfig) -> list[tuple[int, int]]:
    """(in, out) features of the quantized Linears of one GLM block (GLM-4-0414: q, k and v_proj apart)."""
    h, f, attn = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads * arch.kv_channels
    if getattr(arch, "split_qkv", False):
        kv = arch.kv_groups * arch.kv_channels
        return [(h, attn), (h, kv), (h, kv), (attn, h), (h, 2 * f), (f, h)]
    return [(h, arch.qkv_out), (attn, h), (h, 2 * f), (f, h)]


def layer_bytes(d_in: int, d_out: int, quantize: str, double_quant: bool = True) -> int:
    """Stored bytes of one quantized Linear weight (its bias stays in the compute dtype, counted elsewhere)."""
    n = d_in * d_out
    if quantize == "int8":
        return n + 4 * d_out
    blocks = -(-n // NF4_BLOCK)
    scales = blocks + 4 * -(-blocks // NESTED_BLOCK) + NESTED_CODE if double_quant else 4 * blocks
    return (n + 1) // 2 + scales + NF4_CODE


def frozen_weight_bytes(arch: GLMConfig, frozen_params: int, quantize: str, e: int, double_quant: bool = True) -> int:
    """Bytes of the frozen base weights: everything at `e` B/param, less the quantized Linears at their size."""
    if quantize == "none":
        return frozen_params * e
    layers = quantized_linears(arch)
    quantized = arch.num_layers * sum(i * o for i, o in layers)
    return (frozen_params - quantized) * e + arch.num_layers * sum(
        layer_bytes(i, o, quantize, double_quant) for i, o in layers
    )


def working_bytes(arch: GLMConfig, quantize: str, e: int, tokens: int, on_cuda: bool, double_quant: bool = True) -> int:
    """Transient bytes of the quantized Linear that runs: its dequantized weight (+ fp32 absmax, NF4 nested),
    and for int8 on CUDA the input's fp16 + int8 copies and the int32 product."""
    if quantize == "none":
        return 0
    layers = quantized_linears(arch)
    dequant = max(i * o * e + (4 * i * o // NF4_BLOCK if quantize == "nf4" and double_quant else 0) for i, o in layers)
    if quantize == "int8" and on_cuda:
        return dequant + max(tokens * (3 * i + 4 * o) for i, o in layers)
    return dequant


def saved_bytes(arch: GLMConfig, quantize: str, e: int, tokens: int) -> int:
    """Extra bytes one GLM block keeps for backward: int8 Linears keep their inputs ([tokens, in] each)."""
    if quantize != "int8":
        return 0
    return e * tokens * sum(i for i, _ in quantized_linears(arch))


def allows_zero3(run) -> bool:
    """ZeRO-3 shards parameters as flat 16-bit tensors; bitsandbytes weights and their states cannot be."""
    return run.dist.strategy != "ddp" and run.model.quantize == "none"
