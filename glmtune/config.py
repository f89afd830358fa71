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

# The Hydra config tree, shipped inside the package (pyproject package-data) so an installed glmtune finds it.
CONF_DIR = Path(__file__).resolve().parent / "conf"


class ConfigError(ValueError):
    """Bad configuration or input: reported as one line, exit code 2, no traceback."""


@dataclass
class ModelConfig:
    name: str = "glm4_tiny"  # preset name; the architecture facts of released models need no weights
    path: Optional[str] = None  # checkpoint folder (config.json + weights); None = built-in tiny model
    trust_remote_code: bool = False  # opt-in: run the folder's own modeling code instead of glmtune's
    quantize: str = "none"  # none | nf4 | int8: bitsandbytes base weights (QLoRA); changes numerics, so opt-in
    double_quant: bool = True  # nf4: quantize the per-block scales too (~0.37 bit/param less, ~0.4 GB on 9B)


@dataclass
class DataConfig:
    train_file: str = "data/samples/train.jsonl"
    val_file: Optional[str] = None
    max_length: int = 500  # tokens per example after truncation; the planner never changes a value set here
    cache_dir: Optional[str] = None  # tokenized-data cache; None = $GLMTUNE_CACHE/data (~/.cache/glmtune/data)
    num_proc: int = 0  # processes that tokenize a file on a cache miss; 0 = every core this process may use
    packing: str = "auto"  # auto | on | off: several examples per row (data/packing.py); auto = on a GPU when it halves the rows
    pack_length: Optional[int] = None  # positions per packed row; None = max(2048, longest example)


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
    max_steps: int = 0  # 0 = train whole epochs (num_epochs); > 0 = exactly this many optimizer steps instead
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
    compile: str = "auto"  # auto | on | off: torch.compile each decoder block; auto = on CUDA without ZeRO-3
    packed_attention: str = "auto"  # auto | sdpa | flex: attention of packed rows; auto = flex when compiled on CUDA


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
    batch_size: int = 0  # 0 = as many rows as the KV cache fits (the estimator's term); CPU: 8
    gpus: int = 0  # 0 = every visible GPU (CPU when there is none); N = split the model over the first N
    merge_to: Optional[str] = None  # also write base + adapter merged, in the official checkpoint layout
    prompt: Optional[str] = None  # one user message: generate for it (mode=infer) or open chat with it (mode=chat)
    system: Optional[str] = None  # system prompt put in front of infer.prompt and of every chat
    tools_file: Optional[str] = None  # JSON list of GLM-4 tools for chat (official "tools" format)
    image: Optional[str] = None  # GLM-4V: image for infer.prompt / the first chat turn
    do_sample: bool = False  # False = greedy (reproducible); True = sample with the settings below
    temperature: float = 0.8  # sampling only; < 1 sharpens the distribution
    top_p: float = 0.8  # sampling only; nucleus mass kept
    top_k: int = 0  # sampling only; 0 = no top-k cut
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the text
    seed: int = 42  # sampling seed: same seed, same prompts, same outputs
    overwrite: bool = False  # replace an existing output_file / merge_to; the inputs are never written


@dataclass
class EvalConfig:
    generate: bool = False  # also generate a reply for each val example: ROUGE-1/2/L, BLEU-4, exact match
    max_new_tokens: int = 128  # per val example; the plan counts the KV cache of prompt + these tokens
    max_examples: int = 0  # 0 = the whole val set; N = the first N (generation costs ~N x max_new_tokens steps)
    metric_for_best: str = "eval_loss"  # picks the best checkpoint: eval_loss, eval_perplexity, eval_rouge-l, ...
    early_stopping_patience: int = 0  # 0 = off; N = stop after N evaluations without a better metric_for_best


MODES = ("train", "plan", "probe", "infer", "chat")


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
    eval: EvalConfig = field(default_factory=EvalConfig)


# Linear layers of the GLM-4 / ChatGLM3 language model, by their official names (the estimator knows each).
LORA_TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer")

_CHOICES = {
    "mode": MODES,
    "model.quantize": ("none", "nf4", "int8"),
    "dist.strategy": ("auto", "ddp", "zero3"),
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.gradient_checkpointing": ("auto", "on", "off"),
    "train.compile": ("auto", "on", "off"),
    "train.packed_attention": ("auto", "sdpa", "flex"),
    "data.packing": ("auto", "on", "off"),
    "hw.interconnect": ("pcie", "nvlink", "none"),
    "train.resume": ("auto", "always", "restart"),
}
_POSITIVE = ("data.max_length", "lora.r", "lora.alpha", "dist.nnodes", "dist.nproc_per_node",
             "train.per_device_batch_size", "train.grad_accum",
             "train.eval_batch_size", "train.logging_steps", "hw.gpus_per_node", "probe.steps",
             "infer.max_new_tokens", "eval.max_new_tokens", "infer.temperature", "infer.top_p",
             "infer.repetition_penalty", "train.keep_checkpoints")
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
# Metrics an evaluation reports (eval.generate adds the generation ones); True = higher is better.
EVAL_METRICS = {"eval_loss": False, "eval_perplexity": False, "eval_rouge-1": True, "eval_rouge-2": True,
                "eval_rouge-l": True, "eval_bleu-4": True, "eval_exact_match": True}


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
    if cfg.data.pack_length is not None and cfg.data.pack_length < cfg.data.max_length:
        problems.append(f"data.pack_length={cfg.data.pack_length} is shorter than data.max_length="
                        f"{cfg.data.max_length}: a row must hold the longest example — raise it or leave it null")
    if cfg.hw.memory_gib is not None and cfg.hw.memory_gib <= 0:
        problems.append(f"hw.memory_gib must be > 0, got {cfg.hw.memory_gib}")
    if cfg.mode == "infer" and not (cfg.infer.prompts_file or cfg.infer.merge_to or cfg.infer.prompt):
        problems.append("mode=infer needs infer.prompts_file=<jsonl> or infer.prompt=\"...\" "
                        "(and/or infer.merge_to=<folder>)")
    if cfg.infer.prompts_file and cfg.infer.prompt:
        problems.append("set infer.prompts_file or infer.prompt, not both")
    if cfg.infer.batch_size < 0 or cfg.infer.top_k < 0 or cfg.eval.max_examples < 0:
        problems.append("infer.batch_size, infer.top_k and eval.max_examples must be >= 0")
    if cfg.infer.top_p > 1.0:
        problems.append(f"infer.top_p must be in (0, 1], got {cfg.infer.top_p}")
    metric = cfg.eval.metric_for_best
    if metric not in EVAL_METRICS or (metric not in ("eval_loss", "eval_perplexity") and not cfg.eval.generate):
        usable = [m for m in EVAL_METRICS if cfg.eval.generate or m in ("eval_loss", "eval_perplexity")]
        problems.append(f"eval.metric_for_best={metric!r} is not one of {', '.join(usable)}"
                        + ("" if cfg.eval.generate else " (the generation metrics need eval.generate=true)"))
    if cfg.eval.early_stopping_patience < 0:
        problems.append("eval.early_stopping_patience must be >= 0")
    if cfg.data.num_proc < 0:
        problems.append(f"data.num_proc must be >= 0 (0 = every core), got {cfg.data.num_proc}")
    if cfg.model.quantize != "none" and (cfg.dist.strategy == "zero3" or cfg.model.trust_remote_code):
        problems.append(f"model.quantize={cfg.model.quantize} needs glmtune's own model without ZeRO-3 (bitsandbytes "
                        "weights cannot be sharded): use dist.strategy=auto|ddp and model.trust_remote_code=false")
    if cfg.infer.gpus < 0:
        problems.append(f"infer.gpus must be >= 0, got {cfg.infer.gpus}")
    if cfg.train.max_steps < 0:
        problems.append(f"train.max_steps must be >= 0 (0 = whole epochs), got {cfg.train.max_steps}")
    if cfg.train.max_steps <= 0 and cfg.train.num_epochs <= 0:
        problems.append("set train.num_epochs > 0 (or train.max_steps > 0)")
    if cfg.train.learning_rate <= 0:
        problems.append(f"train.learning_rate must be > 0, got {cfg.train.learning_rate}")
    return problems
