"""Per-GPU peak memory of a GLM LoRA training step, from the architecture and run shape alone.

The tensor terms follow what glmtune's own model (models/chatglm/, on models/kernels/) keeps for backward, counted per
storage: RMSNorm keeps its input and (bf16/fp16) an fp32 copy; SDPA keeps q, the GQA-expanded K and V
(expand+reshape copies to all heads), its output and an fp32 log-sum-exp; SwiGLU keeps the fused
h_to_4h output (silu and the product reference it) and silu's output; frozen Linears keep nothing,
a LoRA-wrapped one keeps its (dropped-out) input, the dropout mask and lora_A's output. Reentrant
checkpointing keeps one [tokens, hidden] input per block and recomputes one block in backward. The
reference loss keeps fp32 logits, a shifted contiguous copy and log_softmax's output at once
(14 B/token/vocab in bf16, 12 in fp32); the chunked loss holds that for `loss_chunk_tokens` only.
These are checked against measured live tensor bytes on CPU (tests/test_memory.py, bench/).

Not measured here (no GPU lent): CUDA context, cuBLAS workspaces, NCCL buffers and caching-allocator
slack are per-family constants, marked UNCALIBRATED. ZeRO-1/2 are not modelled on purpose: for LoRA they
shard only adapter gradients and optimizer states (megabytes) and never the frozen weights that fill
the card, so glmtune offers ZeRO stage 0 or 3 only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..models import GLMConfig
from . import longctx, quantized, tiledmlp, variants
from .host import host_breakdown
from .reserve import phase_reserves
from .variants import BYTES, HEADS, linear_shapes, peft_adapter_dtype, roles  # noqa: F401 (shared with variants)
from .archsize import (IMAGE_TOKENS, VISION_LAYER_TOKENS, block_params, frozen_params,  # noqa: F401 (re-exported)
                       image_extra_tokens, vision_params, vision_working)
from ..config.units import MIB


# ZeRO-3 buffer sizes in elements. The prefetch bucket and the largest gathered layer are what ZeRO-3
# adds to a card's peak; the estimator counts them with these same numbers.
PREFETCH_BUCKET = 50_000_000  # 100 MB in bf16: a few projections of a 4096-wide block ahead
REDUCE_BUCKET = 50_000_000  # LoRA gradients are tiny; this bounds the all-reduce buffer
PERSISTENCE_THRESHOLD = 100_000  # parameters smaller than this (norms, biases) stay gathered
MAX_LIVE_PARAMETERS = 1_000_000_000
MAX_REUSE_DISTANCE = 1_000_000_000

# Outside the tensors, per GPU, bytes. Measured on an NVIDIA H100 80GB HBM3 (driver 580.159, torch 2.11 + CUDA
# 13.0, 2026-11-23, bench/gpu_memory.py): what NVML reports for the process beyond the allocator's reserve
# after real training steps (the CUDA context plus the lazily loaded kernel modules) was 758 MiB in every
# non-ZeRO row, and DeepSpeed's NCCL communicator added 566 MiB, even on one GPU. Other families are not
# measured: they take the H100 figure (context size follows the CUDA version more than the chip).
CUDA_CONTEXT = {"hopper": 758 * MIB}
CUDA_CONTEXT_DEFAULT = 758 * MIB
CUBLAS_WORKSPACE = 8_519_680  # 2 x 4 MiB + 8 x 16 KiB, the `:4096:2:16:8` default (inside torch's allocator)
CUBLASLT_WORKSPACE = {"hopper": 32 * MIB}  # 4 MiB elsewhere (pytorch#120925)
NCCL_PER_GPU = 566 * MIB
def gpu_family(hw_name: str) -> str | None:
    """GPU family from a conf/hw preset name; None = CPU / unknown (no CUDA overhead terms)."""
    for key, fam in (("h100", "hopper"), ("h200", "hopper"), ("a100", "ampere"), ("a10", "ampere"),
                     ("3090", "ampere"), ("4090", "ada"), ("l40", "ada"), ("v100", "volta"), ("t4", "turing")):
        if key in hw_name:
            return fam
    return None


@dataclass(frozen=True)
class RunShape:
    """What the estimator needs to know about a run (built by `planner.run_shape` from RunConfig + Choices)."""
    dtype: str = "bf16"
    micro_batch: int = 1
    seq_len: int = 500  # padded tokens per sample incl. image tokens
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("query_key_value",)
    lora_dropout: float = 0.1
    adapter_dtype: str | None = None  # None = peft_adapter_dtype(dtype)
    gradient_checkpointing: bool = False
    loss_chunk_tokens: int = 0
    offload_checkpoints: bool = False  # checkpointed block inputs wait in pinned CPU memory
    # Mixed precision as the Trainer runs it (bf16/fp16 autocast; DeepSpeed's bf16 engine makes the adapters
    # bf16): LoRA's matmuls save their inputs in the compute dtype, not the fp32 of the adapters.
    autocast: bool = False
    zero_stage: int = 0
    offload_params: bool = False
    offload_optimizer: bool = False
    world_size: int = 1
    images_per_sample: int = 0
    eval_batch: int = 0  # 0 = no evaluation
    eval_max_new_tokens: int = 0  # 0 = loss-only evaluation
    device: str = "cuda"  # "cpu": no CUDA terms; dropout keeps a full-dtype mask instead of a bool one
    gpu_family: str | None = None
    quantize: str = "none"  # none | nf4 | int8: bitsandbytes base weights (plan/quantized.py)
    double_quant: bool = True  # nf4: quantized absmax scales
    allocator: str = "expandable"  # expandable | default: the CUDA caching allocator's mode (plan/reserve.py)
    use_dora: bool = False  # DoRA's terms and the 8-bit optimizer's states: plan/variants.py
    document_mask: bool = False  # packed rows on the dense path (sdpa; models/kernels/docattention.py): what estimate() says
    mlp_tile_tokens: int = 0  # >0: the MLP runs in tiles of this many tokens (plan/tiledmlp.py), 0 = whole
    optimizer: str = "adamw_torch"  # adamw_torch | adamw_8bit
    sequence_parallel: int = 1  # ranks sharing each row (Ulysses): per-rank tokens seq/N (plan/longctx.py)
    ranks_per_node: int = 1  # processes on one node: the host-memory terms are per node
    data_tokens: int = 0  # tokens of the tokenized data set (0 = not known when planning)


@dataclass
class Estimate:
    breakdown: dict[str, int]
    peak_bytes: int
    phase: str  # which phase sets the peak (its tensors plus its allocator reserve, on a GPU)
    phases: dict[str, int] = field(default_factory=dict)  # tensor bytes per phase
    reserves: dict[str, int] = field(default_factory=dict)  # allocator reserve per phase (GPU only)
    host: dict[str, int] = field(default_factory=dict)  # bytes in one node's RAM (plan/host.py)


def lora_params(arch: GLMConfig, shape: RunShape) -> int:
    shapes = linear_shapes(arch)
    per = sum(shape.lora_r * (shapes[t][0] + shapes[t][1]) for t in shape.lora_targets if t not in HEADS)
    head = sum(shape.lora_r * sum(shapes[t]) for t in shape.lora_targets if t in HEADS)
    return arch.num_layers * per + head


def _lora_saved(tokens: int, d_in: int, shape: RunShape, a: int) -> int:
    """Bytes a LoRA branch keeps: lora_A's input (dropped-out copy, or the input itself), the dropout
    mask (bool on CUDA, a full-dtype noise tensor on CPU) and lora_A's [tokens, r] output. peft casts the
    input to the adapters' dtype before dropout; under autocast the matmul then saves a compute-dtype copy
    (measured on an H100: all four targets at 512 tokens keep 0.98 GiB less than fp32 inputs would)."""
    mask = 0 if shape.lora_dropout == 0 else (a if shape.device == "cpu" else 1)
    saved = BYTES[shape.dtype] if shape.autocast else a
    return tokens * d_in * (saved + mask) + tokens * shape.lora_r * saved


def _lora_inputs(tokens: int, d_in: int, layers: int, shape: RunShape, a: int) -> int:
    """`layers` LoRA branches on one input (GLM-4-0414's q, k and v_proj): each keeps its own dropped-out (or
    cast) copy, except without dropout in the adapters' own dtype, where all keep the input itself."""
    one = _lora_saved(tokens, d_in, shape, a)
    if shape.lora_dropout == 0 and not shape.autocast and BYTES[shape.dtype] == a:
        return one + (layers - 1) * tokens * shape.lora_r * a
    return layers * one


def block_saved(arch: GLMConfig, shape: RunShape, tokens: int, input_requires_grad: bool) -> int:
    """Bytes one GLMBlock keeps for backward (no checkpointing inside it)."""
    e, a = BYTES[shape.dtype], BYTES[shape.adapter_dtype or peft_adapter_dtype(shape.dtype)]
    h, f, heads, g, d = (arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.kv_groups,
                         arch.kv_channels)
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
    return total + quantized.saved_bytes(arch, shape.quantize, e, tokens) + variants.dora_saved(arch, shape, tokens,
                                                                                                input_requires_grad)


def mlp_saved(arch: GLMConfig, shape: RunShape, tokens: int, rg: bool) -> int:
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


def block_working(arch: GLMConfig, shape: RunShape, tokens: int) -> int:
    """Transient bytes on top of the saved ones while one block runs backward (or forward without grad):
    the SwiGLU gradients (the fused [tokens, 2f] and one [tokens, f] at a time) and two [tokens, h].
    Fitted on an H100 at 8K-32K tokens with checkpointing (bench/RESULTS.md): 4f + 3h over-counted ~50 KB per
    token, the SwiGLU input's storage being freed before the fused gradient is built."""
    e, quant = BYTES[shape.dtype], quantized.working_bytes(arch, shape.quantize, BYTES[shape.dtype], tokens,
                                                           shape.device != "cpu", shape.double_quant)
    f, h, tile = arch.ffn_hidden_size, arch.hidden_size, tiledmlp.tile_in_force(shape, tokens)
    mlp = (tiledmlp.working(e, tokens, tile, f, h, mlp_saved(arch, shape, tile, True)) if tile
           else e * tokens * (3 * f + 2 * h))
    return mlp + quant + variants.dora_working(arch, shape, tokens)


def loss_bytes(arch: GLMConfig, shape: RunShape, tokens: int) -> int:
    """Peak of the loss head. Reference: fp32 logits + shifted contiguous copy + log_softmax output
    (+ the bf16/fp16 logits returned) in forward, log_softmax output + two fp32 gradients in backward:
    12 B per token and vocab entry, 14 in bf16/fp16 with micro-batch > 1 (for one sample the shift is a
    view, no copy). Chunked: 12 B per chunk token and vocab entry (measured on CPU)."""
    e, v = BYTES[shape.dtype], arch.padded_vocab_size
    if shape.loss_chunk_tokens > 0:
        return 12 * min(tokens, shape.loss_chunk_tokens) * v + 2 * e * tokens * arch.hidden_size
    return (12 + (e if e != 4 and shape.micro_batch > 1 else 0)) * tokens * v


def eval_loss_bytes(arch: GLMConfig, shape: RunShape, tokens: int) -> int:
    """Loss head without grad: the 16-bit logits die when rebound to fp32, nothing is kept for backward.
    Reference: fp32 logits + shifted copy + log_softmax = 12 B per token and vocab entry. Chunked: one
    chunk's head output, its fp32 copy and log_softmax."""
    v = arch.padded_vocab_size
    if shape.loss_chunk_tokens > 0:
        return (BYTES[shape.dtype] + 8) * min(tokens, shape.loss_chunk_tokens) * v
    return 12 * tokens * v


def estimate(arch: GLMConfig, shape: RunShape) -> Estimate:
    e = BYTES[shape.dtype]
    a = BYTES[shape.adapter_dtype or peft_adapter_dtype(shape.dtype)]
    n = max(1, shape.world_size) if shape.zero_stage == 3 else 1
    tokens = longctx.local_tokens(shape)  # micro_batch x seq_len, or this rank's shard of it under SP
    h, L = arch.hidden_size, arch.num_layers
    b: dict[str, int] = {}

    # --- model states ---
    frozen = frozen_params(arch)
    if shape.zero_stage == 3:
        largest = max(block_params(arch), arch.padded_vocab_size * h)
        # One rank's partition is the whole parameter: nothing is gathered on top (measured, one H100).
        gathered = min(MAX_LIVE_PARAMETERS, largest + PREFETCH_BUCKET) * e if n > 1 else 0
        # Parameter offload did not keep the weights off the card: on an H100 with DeepSpeed 0.19.8 (reentrant
        # checkpointing, 4K tokens) 17.7 GiB were allocated for 17.5 GiB of weights. Counted as measured, so
        # no plan relies on it; the planner no longer offers it.
        b["frozen weights (ZeRO-3 shard)"] = frozen * e if shape.offload_params else frozen * e // n
        b["ZeRO-3 gathered params + prefetch"] = gathered
    else:
        b["frozen weights"] = quantized.frozen_weight_bytes(arch, frozen, shape.quantize, e, shape.double_quant)
    p_lora = lora_params(arch, shape) + variants.dora_params(arch, shape)  # DoRA: + a magnitude per output row
    if shape.zero_stage == 3:  # DeepSpeed: 16-bit params/grads + fp32 master, Adam m, v, grads, sharded
        b["LoRA weights+grads"] = p_lora * (2 * e) // n
        b["LoRA optimizer (fp32 master, Adam m+v)"] = 0 if shape.offload_optimizer else p_lora * 16 // n
        b["ZeRO-3 gradient reduce bucket"] = min(REDUCE_BUCKET, p_lora) * e
    else:
        b["LoRA weights"] = p_lora * a
        b["LoRA grads"] = p_lora * a * (2 if shape.world_size > 1 else 1)  # + DDP bucket copy
        b["LoRA optimizer (Adam m+v)"] = variants.optimizer_state_bytes(arch, shape, a)

    # --- activations ---
    ckpt = shape.gradient_checkpointing
    if ckpt:  # reentrant: inputs kept per block; input_require_grads makes every block's input need grad
        # Offloaded, they live in pinned host memory; the one being recomputed is back on the card, counted
        # by block_saved's input term.
        kept = 0 if shape.offload_checkpoints else L * e * tokens * h
        # The recomputed block's input is its kept checkpoint input (the same storage) unless it came back
        # from the CPU as a new tensor.
        recompute = block_saved(arch, shape, tokens, True) - (0 if shape.offload_checkpoints else e * tokens * h) \
            - variants.dora_last_saved(arch, shape, tokens)  # DoRA: freed before the backward peak
    else:
        kept = block_saved(arch, shape, tokens, False) + (L - 1) * block_saved(arch, shape, tokens, True)
        recompute = 0
    final_norm = e * tokens * h + (4 * tokens * h if e != 4 else 0)
    b["activations kept for backward"] = kept + final_norm
    b["recomputed block (checkpointing)"] = recompute
    # Under SP, attention's backward (its gradients and the all-to-all buffers) may outgrow the MLP's working set.
    working = max(block_working(arch, shape, tokens), longctx.attention_working(arch, shape, tokens))
    loss = loss_bytes(arch, shape, tokens) + e * tokens * h  # + the final hidden state held by forward()
    b["logits and loss"] = loss
    b["block backward working set"] = working
    if shape.images_per_sample and arch.vision_config:  # frozen ViT (weights in "frozen weights")
        b["vision tower working set"] = vision_working(arch, shape.micro_batch * shape.images_per_sample, e)

    # Packed rows under SDPA: the bool block-diagonal mask [b, s, s] is built once per forward (gone before the loss
    # head), and every attention call turns it into an additive bias of the compute dtype [b, 1, s, s] that its
    # backward keeps: one per block without checkpointing, the recomputed block's alone with it. Measured on CPU (tiny model, 2 blocks at 512:
    # 2 x 512^2 x 4 B more live bytes than unpacked) and on an H200 (RESULTS §11 row 1: 40 blocks at 2,048
    # positions, bf16: the 0.31-0.35 GiB the tensor terms missed).
    mask_bytes = shape.micro_batch * shape.seq_len ** 2 if shape.document_mask else 0
    bias = mask_bytes * e
    kept_bias, recomputed_bias = (0, bias) if ckpt else (L * bias, 0)
    if mask_bytes:
        b["packed-row attention biases"] = kept_bias + recomputed_bias
    states = sum(v for k, v in b.items() if k.startswith(("frozen", "ZeRO", "LoRA")))
    phases = {
        "loss": states + kept + final_norm + loss + kept_bias,
        "backward": states + kept + recompute + working + e * tokens * h + kept_bias + recomputed_bias,
    }
    if "vision tower working set" in b:  # runs before the first GLM block: only the model states coexist
        phases["vision"] = states + b["vision tower working set"]
    # --- evaluation: loss forward without grad, and generation with a KV cache ---
    if shape.eval_batch:
        # The eval loss runs under the training's sequence-parallel layout (train/sequence.py): a shard of each row.
        et, whole = shape.eval_batch * longctx.local_seq(shape), shape.eval_batch * shape.seq_len
        # Without grad nothing is kept between blocks: a block's working set is gone before the loss head runs.
        phases["eval"] = (states + max(eval_loss_bytes(arch, shape, et), block_working(arch, shape, et))
                          + 2 * e * et * h + (shape.eval_batch * shape.seq_len ** 2 * (1 + e) if mask_bytes else 0))
        if shape.eval_max_new_tokens:  # generation decodes whole rows on every rank (no SP): its prompt's prefill
            et = whole
            kv_per_token = L * arch.kv_groups * arch.kv_channels * 2 * e  # 40,960 B for GLM-4 bf16
            cache = kv_per_token * shape.eval_batch * (shape.seq_len + shape.eval_max_new_tokens)
            phases["generate"] = states + cache + block_working(arch, shape, et)
            b["eval KV cache"] = cache
    phase = max(phases, key=phases.get)

    # --- outside the tensors (bytes a GPU process needs beyond its live tensors) ---
    fam = shape.gpu_family
    overhead, reserves = {}, {}
    if shape.device != "cpu" and fam is not None:
        measured = "measured" if fam in CUDA_CONTEXT else "H100 figure"
        overhead[f"CUDA context and kernels ({measured})"] = CUDA_CONTEXT.get(fam, CUDA_CONTEXT_DEFAULT)
        overhead["cuBLAS/cuBLASLt workspaces"] = CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE.get(fam, 4 * MIB)
        if shape.zero_stage == 3 or shape.world_size > 1:
            overhead["NCCL communicator"] = NCCL_PER_GPU
        # Every phase with its own reserve; the peak is the phase whose tensors plus reserve are largest.
        reserves = phase_reserves(arch, shape, e, phases, states)
        phase = max(phases, key=lambda p: phases[p] + reserves[p])
    b.update(overhead)
    if reserves:
        b["allocator reserve"] = reserves[phase]
    host = host_breakdown(arch, shape, frozen, p_lora, shape.ranks_per_node, shape.data_tokens)
    return Estimate(b, phases[phase] + reserves.get(phase, 0) + sum(overhead.values()), phase, phases, reserves, host)
