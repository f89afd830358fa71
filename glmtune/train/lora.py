"""The `lora` config group: PEFT LoRA adapters on glmtune's GLM model."""

from __future__ import annotations

import re

import peft
import torch

from ..config import LORA_TARGETS, ConfigError, LoraConfig
from ..models.quantize import peft_without_bitsandbytes


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> peft.PeftModel:
    """Freeze the base model and add adapters whose weights (and so AdamW states) are fp32."""
    lora = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=_targets(model, cfg),
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
    )
    try:
        with peft_without_bitsandbytes():
            model = peft.get_peft_model(model, lora)
    except ValueError as err:
        if "not found" not in str(err):
            raise
        raise ConfigError(
            f"lora.target_modules={list(cfg.target_modules)} matches no layer of the model — "
            f"GLM models have {', '.join(LORA_TARGETS)}"
        ) from None
    # peft 0.11 creates adapters in the base weights' dtype; bf16 adapters and bf16 Adam moments lose small
    # updates, so keep them fp32 (the estimator counts 4 B per adapter weight, 16 B with grad and moments).
    for param in trainable_parameters(model):
        param.data = param.data.float()
    return model


def _targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str] | str:
    """GLM-4V: the names match inside the vision tower too (its attention.query_key_value/dense, the GLU's
    dense_h_to_4h/dense_4h_to_h), which peft's suffix match would adapt. The tower stays frozen and
    adapter-free, like the official freezeV=True, so a regex (peft full-matches a str) excludes it."""
    modules = getattr(model.config, "lora_modules", None)  # glmtune's configs map names; remote code's has none
    names = list(modules(cfg.target_modules) if modules else cfg.target_modules)
    if not any(".vision." in f"{n}." for n, _ in model.named_modules()):
        return names
    return rf"^(?!.*\.vision\.).*\.({'|'.join(map(re.escape, names))})$"


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
