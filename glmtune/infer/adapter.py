"""Load a LoRA adapter folder without ever unpickling code, and write outputs without overwriting inputs.

peft 0.11.1 reads `adapter_model.bin` with a bare `torch.load`: on torch < 2.6, or with
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 on any torch, a crafted `infer.adapter` then runs its payload. Here
the weights are read by glmtune itself — safetensors (no code by design), or a .bin only through
`torch.load(weights_only=True)` passed explicitly, which no environment variable overrides — and handed
to peft as a ready state dict. A pickle that needs more than tensors is refused with one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, InferConfig
from ..models.quantize import peft_without_bitsandbytes
from .targets import check_export_target, export_inputs


def read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    safe, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safe.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(safe), device="cpu")
        except (SafetensorError, OSError) as err:
            raise ConfigError(
                f"{safe}: unreadable ({str(err).splitlines()[0][:160]}) — the adapter is damaged or "
                "cut short; use the run's adapter folder again or retrain"
            ) from None
    if pickled.is_file():
        try:
            return torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError: all mean "refused"
            reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"{pickled}: refused — not a plain tensor file, and unpickling it could run code "
                f"({reason}); use an adapter_model.safetensors from a run you trust"
            ) from None
    raise ConfigError(
        f"{folder}: no adapter_model.safetensors or adapter_model.bin — point infer.adapter at a run's adapter folder"
    )


def load_adapter(model, adapter: str):
    """base model + adapter (inference mode, not merged yet), or ConfigError naming the file at fault."""
    from peft import PeftConfig, PeftModel
    from peft.utils import set_peft_model_state_dict

    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            f"{folder}: no adapter_config.json — point infer.adapter at a run's adapter folder (<run dir>/adapter)"
        )
    weights = read_adapter_weights(folder)
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, OSError) as err:
        raise ConfigError(f"{folder / 'adapter_config.json'}: unreadable ({err}) — restore it from the run") from None
    config.inference_mode = True
    with peft_without_bitsandbytes():
        model = PeftModel(model, config)
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys or not weights:
        raise ConfigError(
            f"{folder}: the adapter does not fit this model ({len(result.unexpected_keys)} unknown "
            "tensors) — use the model.path the adapter was trained on"
        )
    return model


def check_outputs(cfg: InferConfig, model_dir: Path, run_dir: Path) -> Path | None:
    """Where predictions go; ConfigError if an output would replace an input, or an existing output without
    infer.overwrite=true. model.path and the prompts file are inputs: never written, whatever the flag;
    infer.merge_to is checked by targets.py (before any weights load, as everything here)."""
    inputs = {Path(model_dir).resolve(): "model.path"}
    if cfg.adapter:
        inputs[Path(cfg.adapter).expanduser().resolve()] = "infer.adapter"
    if cfg.merge_to:
        check_export_target("infer.merge_to", cfg.merge_to, *export_inputs(cfg, model_dir, run_dir), cfg.overwrite)
    if not (cfg.prompts_file or cfg.prompt):  # infer.prompt (one-shot) writes predictions.jsonl as well
        return None
    out = Path(cfg.output_file).expanduser() if cfg.output_file else run_dir / "predictions.jsonl"
    if cfg.prompts_file and out.resolve() == Path(cfg.prompts_file).expanduser().resolve():
        raise ConfigError(f"infer.output_file={cfg.output_file} is the prompts file — write predictions elsewhere")
    if any(p in inputs for p in (out.resolve(), *out.resolve().parents)):
        raise ConfigError(
            f"infer.output_file={out} is inside an input folder ({', '.join(inputs.values())}) — "
            "write predictions elsewhere"
        )
    if out.exists() and not cfg.overwrite:
        raise ConfigError(f"{out}: already exists — choose another infer.output_file, or pass infer.overwrite=true")
    return out
