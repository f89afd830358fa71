"""A tiny model with LoRA adapters whose B is not zero (so both A and B get gradients), and one step's loss and
LoRA gradients: what the packing and compile tests compare between two ways of computing the same batch."""

from __future__ import annotations

from pathlib import Path

import torch

from glmtune.config import LoraConfig
from glmtune.models import load_model
from glmtune.train.lora import apply_lora, trainable_parameters


def lora_model(model_dir: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = apply_lora(
        load_model(model_dir, dtype=torch.float32),
        LoraConfig(r=4, dropout=0.0, target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: then A gets no gradient and the test would see half of it
            torch.nn.init.normal_(param, std=0.05)
    return model.eval()  # eval: no dropout anywhere, so both runs compute the same function


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in trainable_parameters(model)]
