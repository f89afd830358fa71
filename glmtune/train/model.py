"""The model a run trains, built as the plan says: the base loaded (or quantized by bitsandbytes) in the plan's
dtype, then loss chunking, checkpoint offload, MLP tiles, LoRA, checkpointing, compiled blocks and the packed-row
attention path applied. The probe builds through here too, so what it measures is what trains.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from ..config import RunConfig
from ..launch.quiet import prints_to_log
from ..models import enable_checkpointing, load_model
from ..models.kernels.layers import set_offload_checkpoints
from ..models.kernels.tiling import set_mlp_tile_tokens
from ..models.quantize import load_quantized
from ..plan.planner import Choices
from .compile import compile_blocks, resolve_compile, resolve_packed_attention, set_packed_attention
from .lora import apply_lora

_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(model_dir: Path, run: RunConfig, choices: Choices) -> torch.nn.Module:
    with prints_to_log(__name__):  # under ZeRO-3, zero.Init's first collective prints a line per rank (quiet.py)
        return _build_model(model_dir, run, choices)


def _build_model(model_dir: Path, run: RunConfig, choices: Choices) -> torch.nn.Module:
    if run.model.quantize != "none":  # bitsandbytes weights in the GLM blocks, loaded straight to this rank's GPU
        model = load_quantized(
            model_dir, run.model.quantize, _TORCH_DTYPE[choices.dtype], double_quant=run.model.double_quant
        )
    else:
        model = load_model(model_dir, dtype=_TORCH_DTYPE[choices.dtype], trust_remote_code=run.model.trust_remote_code)
    return prepare_model(model, run, choices)


def prepare_model(model: torch.nn.Module, run: RunConfig, choices: Choices) -> torch.nn.Module:
    """Everything the plan applies to a loaded base model: loss chunking, checkpoint offload, MLP tiles, LoRA,
    checkpointing. bench/gpu_memory.py calls this on full-size random-weight models built on the GPU."""
    transformers.set_seed(run.train.seed)  # LoRA's A matrices are random: same seed, same start
    model.config.use_cache = False
    if hasattr(model, "loss_chunk_tokens"):  # glmtune's model (not a checkpoint's own remote code)
        model.loss_chunk_tokens = choices.loss_chunk_tokens
        set_offload_checkpoints(model, choices.offload_checkpoints)
        # The probe builds through here too, so it measures the tiles.
        set_mlp_tile_tokens(model, choices.mlp_tile_tokens, zero3=choices.zero_stage == 3)
    model = apply_lora(model, run.lora)
    if choices.gradient_checkpointing:
        enable_checkpointing(model, use_reentrant=run.train.use_reentrant)
        # Reentrant checkpointing only back-propagates into a block when its input requires grad; the
        # embeddings are frozen, so make their output require it.
        model.enable_input_require_grads()
    compiled = resolve_compile(run.train, choices.zero_stage)[0]
    if compiled:
        compile_blocks(model)
    attention = resolve_packed_attention(run.train, compiled, getattr(model.config, "attention_dropout", 0.0))[0]
    set_packed_attention(model, attention)
    return model
