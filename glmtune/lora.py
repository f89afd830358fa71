"""The `lora` config group: PEFT LoRA adapters on glmtune's GLM model."""
from __future__ import annotations

import peft
import torch

from .config import ConfigError, LoraConfig

# Linear layers of a GLM block, by their official names.
BLOCK_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> peft.PeftModel:
    """Freeze the base model and add adapters whose weights (and so AdamW states) are fp32."""
    lora = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=cfg.r, lora_alpha=cfg.alpha,
                           lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules))
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as err:
        if "not found" not in str(err):
            raise
        raise ConfigError(f"lora.target_modules={list(cfg.target_modules)} matches no layer of the model — "
                          f"GLM blocks have {', '.join(BLOCK_LINEARS)} (and output_layer)") from None
    # peft 0.11 creates adapters in the base weights' dtype; bf16 adapters and bf16 Adam moments lose small
    # updates, so keep them fp32 (the estimator counts 4 B per adapter weight, 16 B with grad and moments).
    for param in trainable_parameters(model):
        param.data = param.data.float()
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
