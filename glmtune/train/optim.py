"""train.optimizer: the optimizer over the trainable (LoRA) parameters, for the run, the probe and the CPU
measurement of the estimator (probe/track.py) alike.

    adamw_torch   torch AdamW: fp32 m and v, 8 B per adapter parameter (the official demo's)
    adamw_8bit    bitsandbytes AdamW8bit: blockwise 8-bit m and v, ~2 B per parameter (plan/variants.py counts
                  its states); runs on CPU too with bitsandbytes 0.50. Adapter states are megabytes next to
                  the frozen weights, so this matters for large r, many targets or ZeRO-3's fp32 master copy.
"""

from __future__ import annotations

import torch

# glmtune's names and the Trainer's (TrainingArguments.optim), which training_args.bin records.
HF_NAMES = {"adamw_torch": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}
OPTIMIZERS = {hf: name for name, hf in HF_NAMES.items()}


def make_optimizer(
    name: str, params: list[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    if name == "adamw_8bit":
        import bitsandbytes as bnb  # config validation has checked that it is installed

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
