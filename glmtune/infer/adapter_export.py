"""`infer.adapter_for=peft|vllm`: a run's adapter, unmerged, in the names the engine's model has (the export's
layout, hf_layout.py) and with only what that engine accepts; anything it would refuse or ignore is an error here.

    MERGE_TO/adapter/adapter_config.json        the run's, with target_modules in the layout's names and
                                                base_model_name_or_path = MERGE_TO (the exported base)
    MERGE_TO/adapter/adapter_model.safetensors  base_model.model.<module>.lora_A/lora_B.weight

A fused layer the layout splits (GLM-4's query_key_value -> q_proj, k_proj, v_proj) becomes one LoRA per part
with the same A and B cut by rows (DoRA's per-row magnitude too): each part's B·A is exactly its rows of the
fused B·A, so the split adapter computes the same outputs. vLLM (vllm/lora/peft_helper.py, lora_model.py)
refuses DoRA, modules_to_save, adapter biases and a rank above --max-lora-rank, and raises on a module it has
no LoRA layer for; the check runs before any weights load (check_adapter_for).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import ConfigError, InferConfig
from .adapter import read_adapter_weights
from .hf_layout import Layout, rename, split_rows

# vLLM 0.32's --max-lora-rank choices (vllm/config/lora.py MaxLoRARanks); its default is 16.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<leaf>lora_A\.weight|lora_B\.weight|"
    r"lora_magnitude_vector(?:\.weight)?)$"
)


def read_adapter_config(adapter: str | Path) -> dict:
    path = Path(adapter).expanduser() / "adapter_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: unreadable ({err}) — point infer.adapter at a run's adapter folder") from None


def max_lora_rank(config: dict) -> int:
    """The rank vLLM must allow: r, or the largest of rank_pattern."""
    return max([int(config.get("r") or 0), *map(int, (config.get("rank_pattern") or {}).values())])


def vllm_rank_flag(config: dict) -> int:
    """The smallest --max-lora-rank choice that holds the adapter."""
    rank = max_lora_rank(config)
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def check_adapter_for(cfg: InferConfig, layout: Layout, model_config) -> None:
    """What the engine refuses in the adapter (its config, the modules its tensors adapt), as ConfigError, before
    any weights load (the tensor names come from the safetensors header)."""
    if cfg.adapter_for == "none":
        return
    problems = vllm_problems(read_adapter_config(cfg.adapter)) if cfg.adapter_for == "vllm" else []
    if problems:
        raise ConfigError(
            f"infer.adapter_for=vllm: {cfg.adapter} cannot be served by vLLM: {'; '.join(problems)} "
            "— merge it instead (infer.adapter_for=none), or use infer.adapter_for=peft"
        )
    names = adapter_names(
        _tensor_names(Path(cfg.adapter).expanduser()), cfg.adapter, layout, model_config, cfg.adapter_for
    )
    renamed_patterns(read_adapter_config(cfg.adapter), names, layout, model_config, cfg.adapter_for, cfg.adapter)


def vllm_problems(config: dict) -> list[str]:
    """What vllm/lora/peft_helper.py refuses in an adapter_config.json."""
    problems = []
    if config.get("use_dora"):
        problems.append("it is a DoRA adapter (vLLM does not run DoRA)")
    if config.get("modules_to_save"):
        problems.append(f"it saves whole modules {config['modules_to_save']} (vLLM takes modules_to_save=None)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("it trains biases (vLLM refuses adapter biases)")
    if max_lora_rank(config) > VLLM_LORA_RANKS[-1]:
        problems.append(
            f"its rank {max_lora_rank(config)} is above vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}"
        )
    return problems


def _placed(key: str, layout: Layout, splits: dict, model_config, adapter) -> tuple[str, str, list | None]:
    """(module in the layout, leaf, its split parts or None) of one adapter tensor name; module "" = dropped."""
    found = _KEY.match(key)
    if not found:
        raise ConfigError(
            f"{adapter}: tensor {key} is not a LoRA weight glmtune can convert — merge this adapter "
            "instead (infer.adapter_for=none)"
        )
    module, leaf = found["module"], found["leaf"]
    new = rename(layout, module + ".")
    module = module if new is None else new.removesuffix(".")
    last = module.rpartition(".")[2]
    return module, leaf, (splits[last](model_config) if module and last in splits else None)


def adapter_names(keys, adapter, layout: Layout, model_config, engine: str) -> dict[str, list[str]]:
    """Each adapted module's last name in the adapter -> its last names in the converted one (a split layer has
    several, a dropped one none); ConfigError when the engine takes a LoRA on none of some of them (vLLM refuses
    such an adapter at load: "expected target modules in ... but received ...")."""
    splits = {**layout.splits, **layout.engine_splits.get(engine, {})}
    names: dict[str, list[str]] = {}
    for key in keys:
        module, _, parts = _placed(key, layout, splits, model_config, adapter)
        new = [name for name, _ in parts] if parts else [module.rpartition(".")[2]] if module else []
        names[_KEY.match(key)["module"].rpartition(".")[2]] = new
    targets = {name for new in names.values() for name in new}
    accepted = layout.engine_targets.get(engine)
    if accepted is not None and targets - accepted:
        raise ConfigError(
            f"infer.adapter_for={engine}: {adapter} adapts {', '.join(sorted(targets - accepted))}, "
            f"which {engine} applies no LoRA to in the {layout.name} layout (it takes "
            f"{', '.join(sorted(accepted))}) — retrain without it (lora.target_modules) or merge the "
            "adapter (infer.adapter_for=none)"
        )
    return names


def renamed_patterns(
    config: dict, names: dict[str, list[str]], layout: Layout, model_config, engine: str, adapter
) -> dict:
    """rank_pattern / alpha_pattern (PEFT and vLLM match each key to a module name's end) in the converted names:
    a bare module name becomes its new names (one per part of a split layer); a dotted key is renamed by the
    layout's rules. ConfigError for a key glmtune cannot place, rather than a LoRA scaled by the wrong rank."""
    if not layout.renames:  # the remote layout: the adapter's own names
        return {field_name: dict(config.get(field_name) or {}) for field_name in ("rank_pattern", "alpha_pattern")}
    splits = {**layout.splits, **layout.engine_splits.get(engine, {})}
    out = {}
    for field_name in ("rank_pattern", "alpha_pattern"):
        pattern = {}
        for key, value in (config.get(field_name) or {}).items():
            if "." not in key:
                new = names.get(key, [key])
            elif (path := rename(layout, key + ".")) is not None:
                parent, _, last = path.removesuffix(".").rpartition(".")
                parts = [part for part, _ in splits[last](model_config)] if last in splits else [last]
                new = [f"{parent}.{part}" for part in parts]
            else:
                raise ConfigError(
                    f"{adapter}: adapter_config.json {field_name} key {key!r} names no module glmtune "
                    f"can rename into the {layout.name} layout — give it as a module name "
                    "(e.g. q_proj), or merge the adapter (infer.adapter_for=none)"
                )
            pattern.update(dict.fromkeys(new, value))
        out[field_name] = pattern
    return out


def _tensor_names(folder: Path) -> list[str]:
    safe = folder / "adapter_model.safetensors"
    if not safe.is_file():
        return list(read_adapter_weights(folder))  # a .bin: read_adapter_weights checks it is only tensors
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(safe), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError):
        return list(read_adapter_weights(folder))  # its one-line error for a damaged file


def convert_adapter(adapter: str | Path, out: Path, layout: Layout, model_config, engine: str, base_path: str) -> dict:
    """Write the adapter in `layout`'s names for `engine` into `out`; returns its adapter_config."""
    weights = read_adapter_weights(Path(adapter).expanduser())
    names = adapter_names(weights, adapter, layout, model_config, engine)
    splits = {**layout.splits, **layout.engine_splits.get(engine, {})}
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        module, leaf, parts = _placed(key, layout, splits, model_config, adapter)
        if not module:
            continue
        if parts is None:
            converted[f"base_model.model.{module}.{leaf}"] = tensor
            continue
        parent = module.rpartition(".")[0]
        pieces = (
            [(name, tensor.clone()) for name, _ in parts]
            if leaf == "lora_A.weight"  # each part its copy of A
            else split_rows(tensor, parts, model_config)
        )
        for name, piece in pieces:
            converted[f"base_model.model.{parent}.{name}.{leaf}"] = piece.contiguous()
    config = read_adapter_config(adapter)
    if layout.renames:  # GLM-4V's vision-excluding regex only exists in the remote layout, kept there
        config["target_modules"] = sorted({name for new in names.values() for name in new})
        config.update(renamed_patterns(config, names, layout, model_config, engine, adapter))
    config.update(base_model_name_or_path=base_path, inference_mode=True)
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(converted, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
