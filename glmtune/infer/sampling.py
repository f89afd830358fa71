"""What decides generate()'s outputs (provenance.json), and the batch size that the KV cache leaves room for.

Greedy by default (the same prompts give the same outputs on every run); `infer.do_sample=true` samples
with temperature / top-p / top-k / repetition penalty from `infer.seed`.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, InferConfig
from ..config.units import GIB
from ..models.generation import CPU_BATCH
from ..plan.estimate import RunShape, block_working, estimate

MAX_AUTO_BATCH = 64  # above this, decode steps stop getting cheaper per token on a 9B model (weights-bound ends)


def check_context(cfg: InferConfig, model_config) -> None:
    """infer.max_new_tokens past the model's context (config.json seq_length): each layer's KV cache is
    allocated for all of them at once (models/kvcache.py), so it would fail as an allocation of terabytes."""
    limit = getattr(model_config, "seq_length", None)
    if limit and cfg.max_new_tokens > limit:
        raise ConfigError(
            f"infer.max_new_tokens={cfg.max_new_tokens} is longer than the model's context "
            f"(seq_length {limit} in config.json) — lower it"
        )


def settings(cfg: InferConfig, batch_size: int) -> dict:
    """What decides the outputs, for provenance.json."""
    return {
        "max_new_tokens": cfg.max_new_tokens,
        "batch_size": batch_size,
        "do_sample": cfg.do_sample,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "repetition_penalty": cfg.repetition_penalty,
        "seed": cfg.seed,
    }


def per_row_bytes(arch, dtype: str, prompt_tokens: int, max_new_tokens: int) -> int:
    """Memory one more row of a generate() batch costs: the estimator's KV-cache term for prompt + new tokens,
    plus one block's prefill working set for the prompt (the estimator's `generate` phase, per row)."""
    shape = RunShape(dtype=dtype, seq_len=prompt_tokens, eval_batch=1, eval_max_new_tokens=max_new_tokens, device="cpu")
    return estimate(arch, shape).breakdown["eval KV cache"] + block_working(arch, shape, prompt_tokens)


def auto_batch_size(
    arch, dtype: str, prompt_tokens: int, max_new_tokens: int, prompts: int, free_bytes: int | None
) -> int:
    """The largest batch whose KV cache fits `free_bytes` (None = CPU: a fixed small batch), capped by the
    number of prompts and MAX_AUTO_BATCH."""
    if free_bytes is None:
        return max(1, min(prompts, CPU_BATCH))
    rows = free_bytes // max(1, per_row_bytes(arch, dtype, prompt_tokens, max_new_tokens))
    return int(max(1, min(prompts, MAX_AUTO_BATCH, rows)))


def free_gpu_bytes(memory_gib: float | None, reserve: int) -> int | None:
    """Bytes left on GPU 0 after the weights, minus `reserve`; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    total = int(memory_gib * GIB) if memory_gib else torch.cuda.get_device_properties(0).total_memory
    return max(0, total - torch.cuda.memory_allocated(0) - reserve)
