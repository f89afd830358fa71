"""What every config value must be, beyond its type: the choices of each key, the counts that must be positive or
not negative, the bounds past which a value is a typo, the rules between keys, and the installs a setting needs.
`check_values` returns every problem it finds; validate.parse_config reports them together as one ConfigError.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from .planemit import plan_problems
from .schema import EVAL_METRICS, EXPORT_CHOICES, LORA_TARGETS, MODES, DataConfig, RunConfig
from .serving import serve_problems

_CHOICES = {
    "mode": MODES,
    **EXPORT_CHOICES,  # EXPORT_CHOICES: infer.merge_format, infer.adapter_for
    "model.quantize": ("none", "nf4", "int8"),
    "dist.strategy": ("auto", "ddp", "zero3"),
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.gradient_checkpointing": ("auto", "on", "off"),
    "train.compile": ("auto", "on", "off"),
    "train.loss_normalization": ("tokens", "micro_batch"),
    "train.packed_attention": ("auto", "sdpa", "segments", "flex"),
    "train.tiled_mlp": ("auto", "on", "off"),
    "data.packing": ("auto", "on", "off"),
    "hw.interconnect": ("pcie", "nvlink", "none"),
    "train.resume": ("auto", "always", "restart"),
    "data.format": ("auto", "glm", "alpaca", "sharegpt", "openai"),
    "data.thinking": ("keep", "drop"),
    "train.optimizer": ("adamw_torch", "adamw_8bit"),
    # HF scheduler names that need no arguments beyond warmup (reduce_lr_on_plateau needs a metric per step).
    "train.lr_scheduler": (
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ),
}
TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab")
_POSITIVE = (
    "data.max_length",
    "lora.r",
    "lora.alpha",
    "dist.nnodes",
    "dist.nproc_per_node",
    "train.per_device_batch_size",
    "train.grad_accum",
    "train.eval_batch_size",
    "train.logging_steps",
    "hw.gpus_per_node",
    "probe.steps",
    "infer.max_new_tokens",
    "eval.max_new_tokens",
    "infer.temperature",
    "infer.top_p",
    "infer.repetition_penalty",
    "train.keep_checkpoints",
    "serve.max_batch",
)
# Counts and sizes where 0 means "off" or "use the other key", but a negative value means nothing.
_NON_NEGATIVE = (
    "train.max_steps",
    "train.num_epochs",
    "train.save_steps",
    "train.save_minutes",
    "train.eval_steps",
    "train.warmup_steps",
    "train.weight_decay",
    "train.seed",
    "infer.seed",
    "infer.gpus",
)
# Upper bounds past which a value is a typo, not a setting: a run that would never end (epochs, steps, probe
# steps) or a seed numpy refuses (its range is [0, 2**32)).
_AT_MOST = {
    "train.num_epochs": (10_000, "a typo: no run of more epochs finishes; for long runs set train.max_steps"),
    "train.max_steps": (10**9, "a billion optimizer steps is years of training"),
    "probe.steps": (100, "the probe measures the peak of the first steps; 2 reach the steady state"),
    "train.seed": (2**32 - 1, "numpy's seed range"),
    "infer.seed": (2**32 - 1, "numpy's seed range"),
    "train.grad_accum": (65_536, "the step's sampler indexes every micro-batch of it in memory"),
    "lora.r": (65_536, "wider than any GLM layer: no low rank left"),
    "infer.max_new_tokens": (2**20, "GLM-4's longest context is 1M tokens"),
    "eval.max_new_tokens": (2**20, "GLM-4's longest context is 1M tokens"),
    # GiB: past these a value is a typo (and 1e300 GiB overflows every byte count made of it)
    "hw.memory_gib": (2**14, "no accelerator has 16 TiB of memory"),
    "hw.host_memory_gib": (2**20, "no node has a PiB of RAM"),
}


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
        elif isinstance(value, list):  # data.mix: a weight of inf would be the whole mix, NaN none of it
            out += [(f"{prefix}{f.name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float)]
    return out


def check_values(cfg: RunConfig) -> list[str]:
    problems = [
        f"{key} must be a finite number, got {value}" for key, value in _floats(cfg) if not math.isfinite(value)
    ]
    if problems:
        return problems
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            problems.append(f"{key} must be >= 0, got {_get(cfg, key)}")
    for key, (most, why) in _AT_MOST.items():
        if _get(cfg, key) is not None and _get(cfg, key) > most:
            problems.append(f"{key} must be <= {_number(most)} ({why}), got {_number(_get(cfg, key))}")
    # AdamW's decoupled decay multiplies every weight by (1 - lr x weight_decay) at each step: at 1 or more it
    # zeroes or flips them all, whatever the gradient says.
    if cfg.train.learning_rate * cfg.train.weight_decay >= 1:
        problems.append(
            f"train.weight_decay={cfg.train.weight_decay:g} times train.learning_rate="
            f"{cfg.train.learning_rate:g} must be < 1 (AdamW scales each weight by 1 - lr x weight_decay "
            "per step) — usual weight_decay values are 0 to 0.1"
        )
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
        problems.append(
            f"lora.target_modules has {', '.join(map(repr, unknown))}; GLM layers that take LoRA: "
            f"{', '.join(LORA_TARGETS)}"
        )
    if not 0.1 <= cfg.hw.margin <= 1.0:
        problems.append(f"hw.margin must be in [0.1, 1.0], got {cfg.hw.margin}")
    if cfg.data.pack_length is not None and cfg.data.pack_length < cfg.data.max_length:
        problems.append(
            f"data.pack_length={cfg.data.pack_length} is shorter than data.max_length="
            f"{cfg.data.max_length}: a row must hold the longest example — raise it or leave it null"
        )
    problems += [
        f"{k} must be > 0, got {v}"
        for k in ("hw.memory_gib", "hw.host_memory_gib")  # null: this machine's
        if (v := _get(cfg, k)) is not None and v <= 0
    ]
    if cfg.mode == "infer" and not (cfg.infer.prompts_file or cfg.infer.merge_to or cfg.infer.prompt):
        problems.append(
            'mode=infer needs infer.prompts_file=<jsonl> or infer.prompt="..." (and/or infer.merge_to=<folder>)'
        )
    if cfg.infer.prompts_file and cfg.infer.prompt:
        problems.append("set infer.prompts_file or infer.prompt, not both")
    if cfg.infer.batch_size < 0 or cfg.infer.top_k < 0 or cfg.eval.max_examples < 0:
        problems.append("infer.batch_size, infer.top_k and eval.max_examples must be >= 0")
    if cfg.infer.top_p > 1.0:
        problems.append(f"infer.top_p must be in (0, 1], got {cfg.infer.top_p}")
    metric = cfg.eval.metric_for_best
    if metric not in EVAL_METRICS or (metric not in ("eval_loss", "eval_perplexity") and not cfg.eval.generate):
        usable = [m for m in EVAL_METRICS if cfg.eval.generate or m in ("eval_loss", "eval_perplexity")]
        problems.append(
            f"eval.metric_for_best={metric!r} is not one of {', '.join(usable)}"
            + ("" if cfg.eval.generate else " (the generation metrics need eval.generate=true)")
        )
    if cfg.eval.early_stopping_patience < 0:
        problems.append("eval.early_stopping_patience must be >= 0")
    problems += _data_files_problems(cfg.data)
    if cfg.data.num_proc < 0:
        problems.append(f"data.num_proc must be >= 0 (0 = every core), got {cfg.data.num_proc}")
    if cfg.model.quantize != "none" and (cfg.dist.strategy == "zero3" or cfg.model.trust_remote_code):
        problems.append(
            f"model.quantize={cfg.model.quantize} needs glmtune's own model without ZeRO-3 (bitsandbytes "
            "weights cannot be sharded): use dist.strategy=auto|ddp and model.trust_remote_code=false"
        )
    if (sp := cfg.dist.sequence_parallel) != "auto" and (type(sp) is not int or sp <= 0):  # auto or processes per row
        problems.append(f"dist.sequence_parallel must be auto or an integer > 0, got {sp!r}")
    elif sp not in (1, "auto") and cfg.train.loss_normalization != "tokens":
        problems.append(
            "dist.sequence_parallel needs train.loss_normalization=tokens (a shard's mean is not the row's)"
        )
    rehearse = cfg.probe.rehearse  # auto | true | false (Hydra reads true/false as bools)
    if type(rehearse) is not bool and rehearse != "auto" or (rehearse, cfg.mode) == (True, "train"):
        problems.append(
            f"probe.rehearse={rehearse!r}: use auto, true or false; true rehearses a multi-GPU plan in "
            "mode=probe only (a training run probes the processes it runs on)"
        )
    if cfg.train.max_steps <= 0 and cfg.train.num_epochs <= 0:
        problems.append("set train.num_epochs > 0 (or train.max_steps > 0)")
    if not 0.0 <= cfg.train.warmup_ratio < 1.0:
        problems.append(f"train.warmup_ratio must be in [0, 1), got {cfg.train.warmup_ratio}")
    unknown = [t for t in cfg.train.report_to if t not in TRACKERS]
    if unknown:
        problems.append(f"train.report_to has {', '.join(map(repr, unknown))}; trackers: {', '.join(TRACKERS)}")
    if cfg.train.optimizer == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        problems.append('train.optimizer=adamw_8bit needs bitsandbytes: pip install "glmtune[quant]"')
    # Checked here, with the other installs a run needs, so the model loader below never reports a config error
    # itself. mode=plan only counts quantized bytes and loads nothing.
    if cfg.model.quantize != "none" and cfg.mode != "plan" and importlib.util.find_spec("bitsandbytes") is None:
        problems.append("model.quantize needs bitsandbytes — pip install 'glmtune[quant]' (or model.quantize=none)")
    if cfg.train.optimizer == "adamw_8bit" and cfg.dist.strategy == "zero3":
        problems.append(
            "train.optimizer=adamw_8bit is not used under ZeRO-3 (DeepSpeed keeps its own fp32 states): "
            "use train.optimizer=adamw_torch or dist.strategy=auto|ddp"
        )
    absent = [t for t in cfg.train.report_to if t in TRACKERS and importlib.util.find_spec(t) is None]
    if absent:
        problems.append(
            f"train.report_to has {', '.join(absent)}, not installed: pip install {' '.join(absent)} "
            '(or pip install "glmtune[track]")'
        )
    elif "mlflow" in cfg.train.report_to:
        problems += _mlflow_store_problem()
    if cfg.train.learning_rate <= 0:
        problems.append(f"train.learning_rate must be > 0, got {cfg.train.learning_rate}")
    return problems + serve_problems(cfg) + plan_problems(cfg)


def train_files(cfg: DataConfig) -> list[str]:
    """data.train_file as a list: one string keeps meaning one file."""
    return [cfg.train_file] if isinstance(cfg.train_file, str) else list(cfg.train_file)


def _data_files_problems(cfg: DataConfig) -> list[str]:
    """data.train_file (a path or a list of paths), data.mix (a weight per file) and data.val_size."""
    files = cfg.train_file
    if not (isinstance(files, str) and files) and not (
        isinstance(files, list) and files and all(isinstance(f, str) and f for f in files)
    ):
        return [f"data.train_file must be a file path or a list of them, got {files!r}"]
    problems = []
    if isinstance(files, list) and len(set(files)) < len(files):
        problems.append(
            f"data.train_file lists a file twice ({files}): give each file once and weight it with data.mix"
        )
    if cfg.mix is not None:
        if isinstance(files, str) or len(cfg.mix) != len(files):
            count = 1 if isinstance(files, str) else len(files)
            problems.append(
                f"data.mix={cfg.mix} needs one weight per data.train_file entry ({count} file"
                f"{'' if count == 1 else 's'}): e.g. data.train_file=[a.jsonl,b.jsonl] data.mix=[3,1]"
            )
        elif not all(w > 0 for w in cfg.mix):
            problems.append(
                f"data.mix weights must be > 0, got {cfg.mix} (leave a file out of data.train_file instead)"
            )
    if cfg.val_size < 0 or (cfg.val_size >= 1 and cfg.val_size != int(cfg.val_size)):
        problems.append(f"data.val_size must be a fraction in [0, 1) or a whole number of examples, got {cfg.val_size}")
    if cfg.val_size > 0 and cfg.val_file is not None:
        problems.append(
            f"set data.val_size={cfg.val_size:g} or data.val_file={cfg.val_file}, not both: pass "
            "data.val_file=null to hold the val set out of the train files"
        )
    return problems


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _mlflow_store_problem() -> list[str]:
    """MLflow 3 refuses its file store (./mlruns, file:...) unless MLFLOW_ALLOW_FILE_STORE=true, and says so only
    when the Trainer's callback opens the run, after the model has loaded and the probe has run, as a
    traceback. Read from the environment as mlflow resolves it (an unset URI means sqlite:///mlflow.db unless
    ./mlruns already holds experiments); mlflow itself is not imported here (~1 s)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    existing = any((d / "meta.yaml").exists() for d in Path("mlruns").glob("[0-9]*")) if not uri else False
    file_store = existing or uri.startswith("file:") or (uri and "://" not in uri)
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    spec = importlib.util.find_spec("mlflow")
    origin = Path(spec.origin).parent / "environment_variables.py" if spec and spec.origin else None
    refuses = origin is not None and origin.exists() and "MLFLOW_ALLOW_FILE_STORE" in origin.read_text()
    if not (file_store and refuses and not allowed):
        return []
    return [
        f"train.report_to has mlflow, whose file store ({uri or './mlruns'}) this mlflow refuses: set "
        "MLFLOW_TRACKING_URI=sqlite:///mlflow.db (or a tracking server), or MLFLOW_ALLOW_FILE_STORE=true"
    ]
