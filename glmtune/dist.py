"""The `dist` config group: data parallel or DeepSpeed ZeRO-3, from the plan; who is rank 0.

    python -m glmtune dist=zero3 ...                                   # one process
    torchrun --standalone --nproc_per_node 4 -m glmtune +hw=rtx4090_24g ...   # one node, 4 GPUs
    scripts/torchrun_multinode.sh        # several nodes: torchrun agents meeting at a c10d rendezvous
    scripts/deepspeed_launch.sh          # several nodes: the deepspeed launcher (--no_local_rank, hostfile)
    python -m glmtune -m hydra/launcher=slurm ...   # SLURM via hydra-submitit-launcher (conf/hydra/launcher)

Every launch runs Hydra inside each rank. The ranks agree on one run dir (`run_name`), each logs to
its own `rank<N>.log`, and only rank 0 writes shared files. Under SLURM no torchrun runs inside the
job: srun starts one task per GPU and `export_slurm_env` turns SLURM's variables into torch's.

The DeepSpeed config is generated, never hand-edited: ZeRO-3 with the bucket sizes the estimator
counts, CPU offload of parameters / optimizer states when the plan says so, and 16-bit weight
gathering on save so the saved adapter is the full, un-partitioned one. For LoRA, ZeRO-1 and ZeRO-2
would shard only the adapter's optimizer states and gradients (megabytes), not the frozen weights that
fill the card, so glmtune offers stage 0 or 3 only.
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch

from .plan import Choices

# ZeRO-3 buffer sizes in elements. The prefetch bucket and the largest gathered layer are what ZeRO-3
# adds to a card's peak; the estimator counts them with these same numbers.
PREFETCH_BUCKET = 50_000_000  # 100 MB in bf16: a few projections of a 4096-wide block ahead
REDUCE_BUCKET = 50_000_000  # LoRA gradients are tiny; this bounds the all-reduce buffer
PERSISTENCE_THRESHOLD = 100_000  # parameters smaller than this (norms, biases) stay gathered
MAX_LIVE_PARAMETERS = 1_000_000_000


def deepspeed_config(choices: Choices) -> dict | None:
    """The dict given to TrainingArguments(deepspeed=...), or None for plain data parallel."""
    if choices.zero_stage != 3:
        return None
    zero: dict = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": REDUCE_BUCKET,
        "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
        "stage3_max_reuse_distance": MAX_LIVE_PARAMETERS,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if choices.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if choices.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": choices.dtype == "bf16"},
        "fp16": {"enabled": choices.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
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


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_name(now: str) -> str:
    """The run dir's last part, identical on every rank of one launch.

    torchrun gives every worker the same TORCHELASTIC_RUN_ID (a fresh id under --standalone, --rdzv_id
    otherwise); other launchers set GLMTUNE_RUN_ID or pass hydra.run.dir. A lone process uses the time.
    """
    for var in ("GLMTUNE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var) and os.environ[var] != "none":
            return os.environ[var]
    return now


def export_slurm_env() -> bool:
    """Inside a task that srun started (the submitit launcher, or `srun python -m glmtune` in an sbatch
    script), set torch's env:// variables from SLURM's, as submitit's TorchDistributedEnvironment does.

    Does nothing under torchrun or deepspeed (RANK is already set) and for a single task. Returns whether
    it exported. CUDA_VISIBLE_DEVICES is left alone: each task sees the node's GPUs and the Trainer picks
    cuda:LOCAL_RANK, which a one-GPU mask per task would turn into a missing device.
    """
    env = os.environ
    if "RANK" in env or "SLURM_JOB_ID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    from submitit.slurm.slurm import SlurmJobEnvironment  # the [slurm] extra; parses "gpu[07-08],cpu3"

    tasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"], WORLD_SIZE=str(tasks),
               LOCAL_WORLD_SIZE=str(tasks // nodes), MASTER_ADDR=SlurmJobEnvironment().hostnames[0],
               # the same port on every task without talking: derived from the job id (submitit's rule)
               MASTER_PORT=env.get("MASTER_PORT") or str(20000 + int(env["SLURM_JOB_ID"]) % 40000))
    return True


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
