"""Checkpoint state that any world size and engine can load: LoRA states are megabytes, so keep them whole.

A DDP checkpoint is portable by nature: `optimizer.pt` holds every trainable parameter's AdamW state, in the
order of `trainable_parameters` (the same on every rank and world size); it only needs loading onto the CPU
first (the Trainer maps it to `args.device`, which a gloo run tags `cpu:0`, and torch cannot restore that).
A ZeRO-3 checkpoint holds each rank's shard of the flattened fp32 states: here every save also gathers each
trainable parameter's exp_avg / exp_avg_sq into `optimizer_portable.pt`, keyed by parameter name, so a
ZeRO-3 run can resume as DDP (or on one process).
"""

from __future__ import annotations

from pathlib import Path

import torch

PORTABLE = "optimizer_portable.pt"
OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"


def named_trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the adapter, with the engine's and PEFT's prefixes stripped (`lora_A.default.weight`
    keys as PEFT saves them are not needed: the names only have to agree between two runs of glmtune)."""
    out = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            out.append((name.removeprefix("module.").removeprefix("base_model.model."), param))
    return out


def save_portable_zero3(model, step: int, folder: Path, leader: bool) -> None:
    """Every rank calls it (the gathers are collective); the leader writes `optimizer_portable.pt`."""
    from deepspeed.utils import safe_get_full_optimizer_state

    state = {}
    for name, param in named_trainable(model):
        moments = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        if leader:
            state[name] = {key: value.detach().float().cpu() for key, value in moments.items()}
    if leader:
        torch.save({"step": step, "state": state}, folder / PORTABLE)


def load_portable_into_torch(optimizer: torch.optim.Optimizer, model, folder: Path) -> None:
    """A ZeRO-3 checkpoint's gathered AdamW moments into this (DDP or single-process) run's torch AdamW."""
    saved = torch.load(folder / PORTABLE, map_location="cpu", weights_only=True)
    named = named_trainable(model)
    missing = [name for name, _ in named if name not in saved["state"]]
    if missing:
        raise ValueError(
            f"{folder / PORTABLE}: no optimizer state for {len(missing)} adapter parameters "
            f"(e.g. {missing[0]}) — the checkpoint is from another LoRA shape"
        )
    for name, param in named:
        moments = saved["state"][name]
        optimizer.state[param] = {
            "step": torch.tensor(float(saved["step"])),
            "exp_avg": moments["exp_avg"].to(param.device, param.dtype).view_as(param),
            "exp_avg_sq": moments["exp_avg_sq"].to(param.device, param.dtype).view_as(param),
        }


def load_states(trainer, folder: Path) -> None:
    """The optimizer and scheduler states of a checkpoint into a DDP or single-process run, whatever world size
    or engine wrote it: optimizer.pt read onto the CPU (AdamW's load_state_dict moves each state to its
    parameter's device), or else a ZeRO-3 checkpoint's gathered moments; then scheduler.pt."""
    if (folder / OPTIMIZER).is_file():
        trainer.optimizer.load_state_dict(torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True))
    elif (folder / PORTABLE).is_file():
        load_portable_into_torch(getattr(trainer.optimizer, "optimizer", trainer.optimizer), trainer.model, folder)
    if (folder / SCHEDULER).is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(folder / SCHEDULER, map_location="cpu", weights_only=True))
        # A scheduler's state holds its last rate but does not set it, and gathered moments carry no rate: set
        # the groups' rate from it (the rate an optimizer.pt restored is the same one).
        for group, lr in zip(trainer.optimizer.param_groups, trainer.lr_scheduler.get_last_lr()):
            group["lr"] = lr
