"""DeepSpeed ZeRO-3 for LoRA: the config generated from the plan, and the adapter's fingerprint across shards.

    python -m glmtune dist=zero3 ...              # one process (CPU offload when the plan says so)
    scripts/torchrun.sh 4 +hw=rtx4090_24g ...      # one node, 4 GPUs; the plan turns ZeRO-3 on when needed

The DeepSpeed config is generated, never hand-edited: ZeRO-3 with the bucket sizes the estimator
counts (plan/estimate.py holds them, so both sides read one number), CPU offload of parameters /
optimizer states when the plan says so, and 16-bit weight gathering on save so the saved adapter is
the full, un-partitioned one. For LoRA, ZeRO-1 and ZeRO-2 would shard only the adapter's optimizer
states and gradients (megabytes), not the frozen weights that fill the card, so glmtune offers stage 0
or 3 only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib

import torch

from ..plan.estimate import (
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET,
    REDUCE_BUCKET,
)
from ..plan.planner import Choices

# The buckets the estimator counts (plan/estimate.py): also what an "auto" in the user's file becomes.
BUCKETS = {
    "reduce_bucket_size": REDUCE_BUCKET,
    "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
    "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
    "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
    "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
}


def deepspeed_config(choices: Choices, user: dict | None = None) -> dict | None:
    """The dict given to TrainingArguments(deepspeed=...), or None for plain data parallel. user: the
    dist.deepspeed_config file (config/userds.py checked it), merged with the plan instead of the generated one."""
    if user is not None:
        return merged(user, choices)
    if choices.zero_stage != 3:
        return None
    zero: dict = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        **BUCKETS,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if choices.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if choices.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": choices.dtype == "bf16"},
        "fp16": {
            "enabled": choices.dtype == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # "auto" values are filled by the HF integration from TrainingArguments. No train_batch_size key:
        # its "auto" was filled with world size 1 on CPU and failed DeepSpeed's batch-size check.
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # glmtune passes its own AdamW over the LoRA parameters only.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def merged(user: dict, choices: Choices) -> dict:
    """The user's DeepSpeed config with every "auto" the plan decides filled in: the buckets the estimator
    counted, bf16/fp16 from the plan's dtype, the plan's micro-batch and accumulation. Their other keys stay."""
    out = copy.deepcopy(user)
    zero = out.setdefault("zero_optimization", {"stage": 0})
    for key, value in BUCKETS.items():
        if zero.get(key) == "auto":
            zero[key] = value
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save", "auto") == "auto":
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # the saved adapter is the whole one
    for precision in ("bf16", "fp16"):
        block = out.setdefault(precision, {})
        if block.get("enabled", "auto") == "auto":
            block["enabled"] = choices.dtype == precision
    # The plan may have lowered the micro-batch (raising accumulation): its values win over the file's.
    out["train_micro_batch_size_per_gpu"] = choices.micro_batch_size
    out["gradient_accumulation_steps"] = choices.grad_accum
    if out.get("train_batch_size") == "auto":  # filled with world size 1 on CPU, it failed DeepSpeed's check
        del out["train_batch_size"]
    out.setdefault("gradient_clipping", "auto")
    out.setdefault("zero_allow_untested_optimizer", True)  # glmtune's optimizer over the LoRA parameters
    out.setdefault("steps_per_print", 1_000_000)
    return out


def skip_shm_build() -> None:
    """Before DeepSpeed starts its communication layer: tell it not to build its shared-memory all-reduce.

    On its CPU accelerator DeepSpeed 0.19 JIT-compiles that op (deepspeed_shm_comm: C++ with g++ and ninja,
    ~60 s of one core on a 2-core VM, once per venv, cached in ~/.cache/torch_extensions) whenever its
    communication layer starts, and every other rank waits on the build's lock meanwhile. Only its
    inference_all_reduce (tensor-parallel inference) calls the op; ZeRO-3 training's collectives go through
    torch.distributed. Marked incompatible, DeepSpeed skips the build: a first CPU ZeRO-3 run needs no compiler
    and no extra minute. On a GPU accelerator the op is not built anyway."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the dict build_shm_op() reads


def adapter_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every LoRA tensor (as fp32, by name): equal strings mean identical adapters.

    Under ZeRO-3 each rank holds a shard, so the parameters are gathered first; that is a collective, so
    every rank must call this. Names drop PEFT's adapter name (".default"), so an adapter loaded back with
    `PeftModel.from_pretrained` (whose weights are frozen, hence selected by name) gives the fingerprint
    of the model that was trained.
    """
    named = sorted((n.replace(".default.", "."), p) for n, p in model.named_parameters() if "lora_" in n)
    sharded = [p for _, p in named if hasattr(p, "ds_id")]  # ZeRO-3 partitioned parameters
    digest = hashlib.sha256()
    gathered = contextlib.nullcontext()
    if sharded:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(sharded, modifier_rank=None)
    with gathered:
        for name, param in named:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
