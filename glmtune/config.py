"""Typed run configuration: one dataclass per Hydra config group, validated once.

`python -m glmtune` composes `conf/` with Hydra and hands the plain dict to `parse_config`, which
turns it into these dataclasses. Every unknown key, wrong type and bad value is collected into one
`ConfigError`, so a user fixes a config in one pass instead of one error per run. Only
`glmtune/__main__.py` imports Hydra; everything below it receives these objects.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


class ConfigError(ValueError):
    """Bad configuration or input: reported as one line, exit code 2, no traceback."""


@dataclass
class ModelConfig:
    name: str = "glm4_tiny"  # preset name; the architecture facts of released models need no weights
    path: Optional[str] = None  # checkpoint folder (config.json + weights); None = built-in tiny model
    trust_remote_code: bool = False  # opt-in: run the folder's own modeling code instead of glmtune's


@dataclass
class DataConfig:
    train_file: str = "data/samples/train.jsonl"
    val_file: Optional[str] = None
    max_length: int = 500  # tokens per example after truncation; the planner never changes a value set here


@dataclass
class LoraConfig:
    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["query_key_value"])


@dataclass
class DistConfig:
    strategy: str = "auto"  # auto: the plan decides; ddp: plain data parallel; zero3: DeepSpeed ZeRO-3
    nnodes: int = 1
    nproc_per_node: int = 1


@dataclass
class TrainConfig:
    max_steps: int = 40  # > 0 wins over num_epochs
    num_epochs: float = 1.0
    learning_rate: float = 5e-4
    per_device_batch_size: int = 1  # micro-batch; global batch = this x grad_accum x world size
    grad_accum: int = 1
    eval_batch_size: int = 4
    eval_steps: int = 0  # 0 = no evaluation during training
    save_steps: int = 0  # 0 = save only at the end
    save_minutes: float = 30.0  # also checkpoint every this many minutes of training; 0 = off
    keep_checkpoints: int = 2  # complete checkpoints kept in <run dir>/checkpoints (older ones deleted)
    resume: str = "auto"  # auto | always | restart: what to do with an earlier run in the same run dir
    logging_steps: int = 5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    precision: str = "auto"  # auto | bf16 | fp16 | fp32
    gradient_checkpointing: str = "auto"  # auto | on | off
    use_reentrant: bool = True  # reentrant checkpointing works with ZeRO-3 and frozen params
    seed: int = 42


@dataclass
class HwConfig:
    name: str = "local"  # preset name; "local" = whatever device this process sees
    memory_gib: Optional[float] = None  # per-device budget; None = the device's own memory
    bf16: bool = True  # card supports bfloat16 (Ampere and newer)
    interconnect: str = "pcie"  # pcie | nvlink | none
    gpus_per_node: int = 1
    margin: float = 0.9  # fraction of memory_gib the plan may use; the rest absorbs estimator error


@dataclass
class ProbeConfig:
    enabled: bool = True  # measure a few real steps before training and step the plan down if needed
    steps: int = 2  # optimizer steps per attempt: the second one has Adam states, the steady-state peak


@dataclass
class InferConfig:
    prompts_file: Optional[str] = None  # JSONL of {"messages": [...]}, each ending on the user turn to answer
    adapter: Optional[str] = None  # a run's adapter folder; None = the base model alone
    output_file: Optional[str] = None  # None = <run dir>/predictions.jsonl
    max_new_tokens: int = 256
    batch_size: int = 4
    gpus: int = 0  # 0 = every visible GPU (CPU when there is none); N = split the model over the first N
    merge_to: Optional[str] = None  # also write base + adapter merged, in the official checkpoint layout
    overwrite: bool = False  # replace an existing output_file / merge_to; the inputs are never written


MODES = ("train", "plan", "probe", "infer")


@dataclass
class RunConfig:
    mode: str = "train"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hw: HwConfig = field(default_factory=HwConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    infer: InferConfig = field(default_factory=InferConfig)


# Linear layers of the GLM-4 / ChatGLM3 language model, by their official names (the estimator knows each).
LORA_TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer")

_CHOICES = {
    "mode": MODES,
    "dist.strategy": ("auto", "ddp", "zero3"),
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.gradient_checkpointing": ("auto", "on", "off"),
    "hw.interconnect": ("pcie", "nvlink", "none"),
    "train.resume": ("auto", "always", "restart"),
}
_POSITIVE = ("data.max_length", "lora.r", "lora.alpha", "dist.nnodes", "dist.nproc_per_node",
             "train.per_device_batch_size", "train.grad_accum",
             "train.eval_batch_size", "train.logging_steps", "hw.gpus_per_node", "probe.steps",
             "infer.max_new_tokens", "infer.batch_size", "train.keep_checkpoints")
# Counts and sizes where 0 means "off" or "use the other key", but a negative value means nothing.
_NON_NEGATIVE = ("train.max_steps", "train.num_epochs", "train.save_steps", "train.save_minutes",
                 "train.eval_steps", "train.warmup_steps", "train.weight_decay", "train.seed")


def parse_config(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a plain (resolved) dict, reporting every problem at once."""
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    if not problems:
        problems += _check_values(cfg)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
    return cfg


GROUPS = ("model", "data", "lora", "dist", "train", "hw", "hparams_search")


def check_override_keys(argv: list[str]) -> None:
    """Reject command-line `key=value` overrides whose key the schema does not have, before Hydra sees them.

    Hydra's own message for `train.lrr=1` is a multi-line error with exit code 1 that names no valid key;
    this one names every unknown key and the valid keys beside it, as parse_config does for YAML."""
    problems = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in GROUPS:
            problems += _group_problems(arg)
            continue
        if key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue
        cls, parts = RunConfig, key.split(".")
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                where = ".".join(parts[:i]) or "<root>"
                problems.append(f"unknown key '{key}' (valid keys under {where}: {', '.join(names)})")
                break
            hint = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(hint):
                break
            cls = hint
    if problems:
        raise ConfigError("invalid command line: " + "; ".join(problems))


CONF = Path(__file__).resolve().parent.parent / "conf"


def _group_problems(arg: str) -> list[str]:
    """`model=nonexistent`, `+hw=nonexistent`, `hw=a100_40g` (no `+`): named here with the valid options,
    instead of Hydra's multi-line "Could not find" / "Could not override" and exit code 1."""
    raw_key, value = arg.split("=", 1)
    key = raw_key.lstrip("+~")
    if raw_key.startswith("~") or not (CONF / key).is_dir():
        return []
    options = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
    if key in ("hw", "hparams_search") and not raw_key.startswith("+"):
        return [f"{key} is not in the defaults list: write +{key}={value} (options: {', '.join(options)})"]
    if "(" in value or "$" in value:  # a sweep function (choice(...), range(...)) or an interpolation
        return []
    return [f"{key}={name} is not an option (options: {', '.join(options)})"
            for name in (v.strip() for v in value.split(",")) if name and name not in options]


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    where = prefix.rstrip(".") or "<root>"
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            problems.append(f"unknown key '{prefix}{key}' (valid keys under {where}: {', '.join(names)})")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], prefix + name, problems)
    return cls(**{k: v for k, v in kwargs.items() if v is not _BAD})


_BAD = object()


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", problems)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key} must be a list, got {value!r}")
            return _BAD
        return [_coerce(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        problems.append(f"{key} must be {hint.__name__}, got {value!r}")
        return _BAD
    return value


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _floats(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every float field of the config, by dotted key (NaN and inf pass every `<= 0` test, so they are caught
    here once for all keys)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            out.append((prefix + f.name, value))
    return out


def _check_values(cfg: RunConfig) -> list[str]:
    problems = [f"{key} must be a finite number, got {value}" for key, value in _floats(cfg) if not math.isfinite(value)]
    if problems:
        return problems
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            problems.append(f"{key} must be >= 0, got {_get(cfg, key)}")
    if cfg.train.seed >= 2**32:
        problems.append(f"train.seed must be < 2**32 (numpy's seed range), got {cfg.train.seed}")
    for key, allowed in _CHOICES.items():
        if _get(cfg, key) not in allowed:
            problems.append(f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            problems.append(f"{key} must be > 0, got {_get(cfg, key)}")
    if not 0.0 <= cfg.lora.dropout < 1.0:
        problems.append(f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
    if not cfg.lora.target_modules:
        problems.append("lora.target_modules must name at least one module")
    unknown = [t for t in cfg.lora.target_modules if t not in LORA_TARGETS]
    if unknown:
        problems.append(f"lora.target_modules has {', '.join(map(repr, unknown))}; GLM layers that take LoRA: "
                        f"{', '.join(LORA_TARGETS)}")
    if not 0.1 <= cfg.hw.margin <= 1.0:
        problems.append(f"hw.margin must be in [0.1, 1.0], got {cfg.hw.margin}")
    if cfg.hw.memory_gib is not None and cfg.hw.memory_gib <= 0:
        problems.append(f"hw.memory_gib must be > 0, got {cfg.hw.memory_gib}")
    if cfg.mode == "infer" and not (cfg.infer.prompts_file or cfg.infer.merge_to):
        problems.append("mode=infer needs infer.prompts_file=<jsonl> (and/or infer.merge_to=<folder>)")
    if cfg.infer.gpus < 0:
        problems.append(f"infer.gpus must be >= 0, got {cfg.infer.gpus}")
    if cfg.train.max_steps <= 0 and cfg.train.num_epochs <= 0:
        problems.append("set train.max_steps > 0 or train.num_epochs > 0")
    if cfg.train.learning_rate <= 0:
        problems.append(f"train.learning_rate must be > 0, got {cfg.train.learning_rate}")
    return problems
