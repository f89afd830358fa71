"""Which base and adapter produced a run's outputs, and refusing an adapter trained on another base.

Training writes `glmtune_base.json` into the adapter folder: the identity of the base checkpoint it was
trained on. Inference compares it with the base it is given, and writes `provenance.json` into its run dir.

The identity of a base is read from its files, never from loaded weights (under ZeRO-3 a rank holds only a
shard): a hash of config.json without its volatile keys (architecture and tokens), and a hash of the first
4 rows of the output layer (4 x hidden values, 32 KB for GLM-4 in bf16), sliced out of the safetensors file
that holds it. Two checkpoints of one architecture (glm-4-9b vs glm-4-9b-chat) differ in the second hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..config import ConfigError

BASE_FILE = "glmtune_base.json"
# Keys of config.json that change with the tool that wrote it, not with the model.
_VOLATILE = (
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "torch_dtype",
    "use_cache",
    "architectures",
    "auto_map",
)
# The output layer, by the family's name: ChatGLM's, GLM-4-0414's (HF).
_SAMPLE_TENSORS = ("transformer.output_layer.weight", "lm_head.weight")
_SAMPLE_ROWS = 4


def config_hash(model_dir: Path) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def weights_sample_hash(model_dir: Path) -> str | None:
    """sha256 of a few output-layer rows as stored (None for .bin checkpoints: reading one means reading all)."""
    from safetensors import safe_open

    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / weight_map[n] for n in _SAMPLE_TENSORS if n in weight_map][:1]
    else:
        files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            name = next((n for n in _SAMPLE_TENSORS if n in f.keys()), None)
            if name is not None:
                tensor = f.get_slice(name)[:_SAMPLE_ROWS]
                return hashlib.sha256(tensor.float().numpy().tobytes()).hexdigest()[:16]
    return None


def base_identity(model_dir: Path) -> dict[str, Any]:
    return {
        "path": str(model_dir),
        "config_sha256": config_hash(model_dir),
        "weights_sample_sha256": weights_sample_hash(model_dir),
    }


def adapter_identity(adapter: str | Path) -> dict[str, Any]:
    """The adapter folder, the sha256 of its weight file, and the trained-tensor fingerprint the training run
    recorded (metrics.json `adapter_sha256` beside the folder) when there is one."""
    folder = Path(adapter)
    weights = next(
        (folder / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()), None
    )
    out: dict[str, Any] = {
        "path": str(folder),
        "file_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights else None,
    }
    metrics = folder.parent / "metrics.json"
    if metrics.is_file():
        out["trained_fingerprint"] = json.loads(metrics.read_text()).get("adapter_sha256")
    return out


def write_base_identity(adapter_dir: Path, model_dir: Path) -> None:
    (Path(adapter_dir) / BASE_FILE).write_text(json.dumps(base_identity(model_dir), indent=2) + "\n")


def check_adapter_base(adapter: str | Path, model_dir: Path, base_config: Any) -> None:
    """ConfigError (exit 2) when the adapter was not trained on this base: recorded identity, then shapes."""
    folder = Path(adapter)
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            f"infer.adapter={adapter}: no adapter_config.json there — point it at a run's adapter/ folder"
        )
    recorded = folder / BASE_FILE
    if recorded.is_file():
        try:
            trained_on, here = json.loads(recorded.read_text()), base_identity(model_dir)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{recorded}: unreadable ({err}) — restore it from the run, or delete it to check the "
                "adapter's shapes only"
            ) from None
        for key, what in (("config_sha256", "architecture (config.json)"), ("weights_sample_sha256", "weights")):
            if trained_on.get(key) and here.get(key) and trained_on[key] != here[key]:
                raise ConfigError(
                    f"infer.adapter={adapter} was trained on {trained_on['path']}, whose {what} "
                    f"differs from model.path {model_dir} — use the base it was trained on"
                )
    _check_shapes(folder, base_config)


def _check_shapes(folder: Path, config: Any) -> None:
    """An adapter from elsewhere (no glmtune_base.json): its LoRA matrices must fit this base's layers."""
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return
    from safetensors import SafetensorError, safe_open

    h, layers = config.hidden_size, config.num_layers
    try:
        with safe_open(str(weights), "pt") as f:
            shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    except (SafetensorError, OSError) as err:  # cut short, or not a safetensors file at all
        raise ConfigError(
            f"{weights}: unreadable ({str(err).splitlines()[0][:160]}) — the adapter file is damaged "
            "or cut short; copy it again from the run, or retrain"
        ) from None
    for name, shape in shapes.items():
        number = name.split(".layers.")[-1].split(".")[0]
        if "lora_A" in name and ".layers." in name and number.isdigit():
            index = int(number)
            d_in = shape[1] if len(shape) == 2 else None
            # The Linears whose input is not the hidden state: the MLP's down projection, attention's output.
            expected = (
                config.ffn_hidden_size
                if ("dense_4h_to_h" in name or "down_proj" in name)
                else (
                    config.num_attention_heads * config.kv_channels
                    if name.endswith(("dense.lora_A.weight", "o_proj.lora_A.weight"))
                    else h
                )
            )
            if index >= layers or d_in != expected:
                raise ConfigError(
                    f"infer.adapter={folder}: {name} takes {d_in} inputs but this base "
                    f"({layers} layers, hidden {h}) has {expected} there — the adapter was "
                    f"trained on another model; use its base"
                )


def write_provenance(
    run_dir: Path, model_dir: Path, config_sha: str | None, adapter: str | None, settings: dict[str, Any]
) -> Path:
    data = {
        "base": {**base_identity(model_dir), "run_config_sha256": config_sha},
        "adapter": adapter_identity(adapter) if adapter else None,
        "settings": settings,
    }
    out = Path(run_dir) / "provenance.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return out
