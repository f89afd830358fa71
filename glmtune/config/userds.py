"""dist.deepspeed_config=FILE.json: the user's own DeepSpeed config, read and checked against the run once
(`load`), into a typed value the plan, the probe and the trainer are handed (UserDeepSpeed).

    glmtune dist.deepspeed_config=ds_zero3_offload.json +hw=rtx4090_24g dist.nproc_per_node=2 ...

The file decides the ZeRO stage (3: weights sharded, the plan's ZeRO-3 terms; 0-2: for LoRA these shard only
megabytes of adapter states, so the plan counts stage 0, an upper bound) and the offloads (offload_param:
DeepSpeed 0.19.8 kept the whole model on the card when measured, so the plan counts the weights unsharded;
offload_optimizer: the adapter's states leave the card). Every "auto" in it is filled from the plan
(train/zero3.py). A value that contradicts the run is one line, exit 2: optimizer and scheduler blocks (glmtune
builds its own over the LoRA parameters: train.optimizer, train.lr_scheduler), a batch size other than the
config's, a precision the plan did not choose, stage 3 with dist.strategy=ddp or with model.quantize.
dist.strategy=auto takes the file's stage (`with_strategy`): ZeRO-3 for stage 3, plain data parallel below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .schema import RunConfig
from .validate import ConfigError, read_json_object

# Keys whose number must equal a glmtune setting (or be "auto"): key -> (config key, attribute of TrainConfig).
_SAME = {
    "train_micro_batch_size_per_gpu": ("train.per_device_batch_size", "per_device_batch_size"),
    "gradient_accumulation_steps": ("train.grad_accum", "grad_accum"),
}


@dataclass(frozen=True)
class UserDeepSpeed:
    """dist.deepspeed_config as read and checked by `load`: the file's settings the plan counts, and its JSON
    object, which train/zero3.merged copies with the plan's values where it says "auto" (never changed here)."""

    path: str  # as given in dist.deepspeed_config
    data: dict[str, Any]
    stage: int  # zero_optimization.stage; 0 without that block
    offload_params: bool  # zero_optimization.offload_param.device is not "none"
    offload_optimizer: bool  # zero_optimization.offload_optimizer.device is not "none"

    @property
    def strategy(self) -> str:
        """What dist.strategy=auto becomes: ZeRO-3 shards the weights; stages 0-2 shard only adapter states."""
        return "zero3" if self.stage == 3 else "ddp"


def read(path: str) -> dict[str, Any]:
    shown, file = path, Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"{shown}: DeepSpeed config not found — fix dist.deepspeed_config (relative to the launch "
            f"directory {Path.cwd()})"
        )
    return read_json_object(file, shown, "fix the file given as dist.deepspeed_config")


def zero(data: dict[str, Any]) -> tuple[int, bool, bool]:
    """(stage, offload_param, offload_optimizer) as the file sets them (stage 0 without zero_optimization)."""
    z = data.get("zero_optimization") or {}

    def offloaded(key: str) -> bool:
        return isinstance(z.get(key), dict) and z[key].get("device", "none") not in ("none", None)

    stage = z.get("stage", 0)
    return (stage if isinstance(stage, int) else -1), offloaded("offload_param"), offloaded("offload_optimizer")


def check(data: dict[str, Any], run: RunConfig, shown: str) -> None:
    """Every contradiction between the file and the run, in one ConfigError."""
    stage, _, _ = zero(data)
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage={stage!r} is not 0, 1, 2 or 3")
    for block, key in (("optimizer", "train.optimizer"), ("scheduler", "train.lr_scheduler")):
        if block in data:
            problems.append(
                f'has an "{block}" block, but glmtune builds its own over the LoRA parameters — remove it and set {key}'
            )
    for key, (config_key, attr) in _SAME.items():
        value = data.get(key, "auto")
        if value != "auto" and value != getattr(run.train, attr):
            problems.append(
                f'{key}={value} but {config_key}={getattr(run.train, attr)} — make them equal or write "auto"'
            )
    if stage == 3 and run.dist.strategy == "ddp":
        problems.append("sets ZeRO stage 3 but dist.strategy=ddp — drop one of them")
    if stage in (0, 1, 2) and run.dist.strategy == "zero3":
        problems.append(f"sets ZeRO stage {stage} but dist.strategy=zero3 — drop one of them")
    if stage == 3 and run.model.quantize != "none":
        problems.append(f"sets ZeRO stage 3, which cannot shard model.quantize={run.model.quantize} weights")
    for precision in ("bf16", "fp16"):
        enabled = (data.get(precision) or {}).get("enabled", "auto")
        wanted = run.train.precision
        if enabled is True and wanted not in ("auto", precision):
            problems.append(f'{precision}.enabled=true but train.precision={wanted} — make them agree or write "auto"')
    if problems:
        raise ConfigError(f"{shown}: " + "; ".join(problems))


def load(run: RunConfig) -> UserDeepSpeed | None:
    """Read and check dist.deepspeed_config (None when unset); every contradiction with `run` is one ConfigError."""
    if not run.dist.deepspeed_config:
        return None
    data = read(run.dist.deepspeed_config)
    check(data, run, run.dist.deepspeed_config)
    return UserDeepSpeed(run.dist.deepspeed_config, data, *zero(data))


def with_strategy(run: RunConfig, user: UserDeepSpeed | None) -> RunConfig:
    """`run` with dist.strategy=auto decided by the file's stage (a copy; `run` itself is left as it is)."""
    if user is None or run.dist.strategy != "auto":
        return run
    return replace(run, dist=replace(run.dist, strategy=user.strategy))
