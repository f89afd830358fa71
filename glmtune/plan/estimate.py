"""Per-GPU peak memory of a GLM LoRA training step, from the architecture and run shape alone.

The tensor terms of one block, the MLP and the loss head are terms.py's, checked against measured live tensor
bytes on CPU (tests/plan/test_memory.py, bench/).

Not measured here (no GPU lent): CUDA context, cuBLAS workspaces, NCCL buffers and caching-allocator
slack are per-family constants, marked UNCALIBRATED. ZeRO-1/2 are not modelled on purpose: for LoRA they
shard only adapter gradients and optimizer states (megabytes) and never the frozen weights that fill
the card, so glmtune offers ZeRO stage 0 or 3 only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.units import MIB
from ..models import GLMConfig
from . import longctx, quantized, variants
from .archsize import (
    IMAGE_TOKENS,
    VISION_LAYER_TOKENS,
    block_params,
    frozen_params,  # noqa: F401 (re-exported)
    image_extra_tokens,
    vision_params,
    vision_working,
)
from .host import host_breakdown
from .reserve import phase_reserves
from .terms import block_saved, block_working, eval_loss_bytes, lora_params, loss_bytes  # noqa: F401 (re-exported)
from .variants import BYTES, HEADS, linear_shapes, peft_adapter_dtype, roles  # noqa: F401 (shared with variants)

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
    for key, fam in (
        ("h100", "hopper"),
        ("h200", "hopper"),
        ("a100", "ampere"),
        ("a10", "ampere"),
        ("3090", "ampere"),
        ("4090", "ada"),
        ("l40", "ada"),
        ("v100", "volta"),
        ("t4", "turing"),
    ):
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
    document_mask: bool = (
        False  # packed rows on the dense path (sdpa; models/kernels/docattention.py): what estimate() says
    )
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
        recompute = (
            block_saved(arch, shape, tokens, True)
            - (0 if shape.offload_checkpoints else e * tokens * h)
            - variants.dora_last_saved(arch, shape, tokens)
        )  # DoRA: freed before the backward peak
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
    mask_bytes = shape.micro_batch * shape.seq_len**2 if shape.document_mask else 0
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
        phases["eval"] = (
            states
            + max(eval_loss_bytes(arch, shape, et), block_working(arch, shape, et))
            + 2 * e * et * h
            + (shape.eval_batch * shape.seq_len**2 * (1 + e) if mask_bytes else 0)
        )
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
