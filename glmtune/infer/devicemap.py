"""Device maps for inference on several GPUs: whole GLM blocks per device, the vision tower on one device.

    from glmtune.devicemap import device_map
    dmap = device_map(build_meta_model(config, torch.bfloat16), [23.6 * GIB] * 2)   # e.g. 2x RTX 3090
    model = accelerate.dispatch_model(model, dmap)

Why not ChatGLM3's old `auto_configure_device_map` or a hand-written dict: they forget tensors. The
reported failures (glm4-facts §11.3, §11.4) are maps without `transformer.rotary_pos_emb.inv_freq` (a
buffer, not a parameter), maps written for 28 layers used on 40, maps whose keys lack PEFT's
`base_model.model.` prefix, and `auto` maps that split the vision tower over two GPUs. Here the map is
built from the model's own module tree (a meta-device model: no weights needed) and `check_complete`
refuses any map that leaves a parameter or buffer unplaced, naming them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..config.units import GIB


@dataclass(frozen=True)
class Unit:
    """A module that must live on one device, in execution order, with its weight bytes."""

    name: str
    nbytes: int


def _prefix(model: nn.Module) -> str:
    """'' for glmtune's model, 'base_model.model.' for a PEFT-wrapped one: wherever `transformer` sits."""
    for name, module in model.named_modules():
        if (name == "transformer" or name.endswith(".transformer")) and hasattr(module, "encoder"):
            return name[: -len("transformer")]
    raise ValueError("not a GLM model: no `transformer` module with an `encoder`")


def _nbytes(module: nn.Module, dtype: torch.dtype | None) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(
        t.numel() * (torch.tensor([], dtype=dtype).element_size() if dtype else t.element_size()) for t in tensors
    )


def _hf_units(model: nn.Module, dtype: torch.dtype | None) -> list[Unit] | None:
    """GLM-4-0414's tree (transformers' names): embed_tokens, rotary_emb, each decoder layer, norm, lm_head; None for
    the ChatGLM family."""
    found = next(((name, module) for name, module in model.named_modules() if name.endswith("lm_head")), None)
    if found is None:
        return None
    p = found[0][: -len("lm_head")]
    core = model.get_submodule(p + "model")
    order = [("model.embed_tokens", core.embed_tokens), ("model.rotary_emb", core.rotary_emb)]
    order += [(f"model.layers.{i}", layer) for i, layer in enumerate(core.layers)]
    order += [("model.norm", core.norm), ("lm_head", found[1])]
    return [Unit(p + name, _nbytes(module, dtype)) for name, module in order]


def units(model: nn.Module, dtype: torch.dtype | None = None) -> list[Unit]:
    """Placement units in execution order: vision tower (GLM-4V), embedding, rotary table, each GLMBlock,
    final norm, output layer. dtype None = the tensors' own dtype (a meta model built in bf16 gives bf16)."""
    hf = _hf_units(model, dtype)
    if hf is not None:
        return hf
    p = _prefix(model)
    core = model.get_submodule(p + "transformer")
    order = [
        ("vision", getattr(core, "vision", None)),
        ("embedding", core.embedding),
        ("rotary_pos_emb", core.rotary_pos_emb),
    ]
    order += [(f"encoder.layers.{i}", layer) for i, layer in enumerate(core.encoder.layers)]
    order += [("encoder.final_layernorm", core.encoder.final_layernorm), ("output_layer", core.output_layer)]
    # Anything else directly under `transformer` (e.g. a P-tuning prefix_encoder) goes first, beside the
    # embedding, so a new submodule can never be silently left out.
    known = {name.split(".")[0] for name, module in order if module is not None}
    extra = [(name, module) for name, module in core.named_children() if name not in known and name != "encoder"]
    return [
        Unit(f"{p}transformer.{name}", _nbytes(module, dtype)) for name, module in extra + order if module is not None
    ]


def device_map(
    model: nn.Module, budgets: list[float], dtype: torch.dtype | None = None, reserve: float = 0.0
) -> dict[str, int]:
    """{module name: GPU index} for len(budgets) GPUs with budgets[i] bytes each.

    Units are placed in execution order; each device takes units until it holds its share of the total
    (proportional to its budget, so the layers spread evenly and activations cross few boundaries), and
    never more than budget - reserve (`reserve` bytes per GPU are kept for activations and the KV cache).
    Raises ValueError when the weights do not fit."""
    plan = units(model, dtype)
    total = sum(u.nbytes for u in plan)
    capacity = [b - reserve for b in budgets]
    if sum(capacity) < total:
        raise ValueError(
            f"weights need {total / GIB:.1f} GiB but {len(budgets)} GPU(s) offer "
            f"{sum(capacity) / GIB:.1f} GiB after the {reserve / GIB:.1f} GiB reserve each"
        )
    share = [total * c / sum(capacity) for c in capacity]
    mapping: dict[str, int] = {}
    used = [0] * len(budgets)
    device = 0
    for unit in plan:
        # Move on when this device already holds its share (half a unit of slack rounds to the nearer
        # boundary) or the unit would not fit; the last device takes the rest.
        while device < len(budgets) - 1 and (
            used[device] + unit.nbytes / 2 > share[device]
            and used[device] > 0
            or used[device] + unit.nbytes > capacity[device]
        ):
            device += 1
        if used[device] + unit.nbytes > capacity[device]:
            raise ValueError(
                f"{unit.name} ({unit.nbytes / GIB:.2f} GiB) does not fit on GPU {device}: "
                f"{used[device] / GIB:.2f} of {capacity[device] / GIB:.2f} GiB used — add a GPU or "
                "lower the reserve"
            )
        mapping[unit.name] = device
        used[device] += unit.nbytes
    check_complete(model, mapping)
    return mapping


def unplaced(model: nn.Module, mapping: dict[str, int | str]) -> list[str]:
    """Names of parameters and buffers (persistent or not) that no key of `mapping` covers."""

    def covered(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in mapping for i in range(len(parts) + 1)) or "" in mapping

    # Buffers first: they are the tensors hand-written maps forget (inv_freq is not a parameter).
    names = [n for n, _ in model.named_buffers()] + [n for n, _ in model.named_parameters()]
    return [n for n in names if not covered(n)]


def check_complete(model: nn.Module, mapping: dict[str, int | str]) -> None:
    """Refuse a map that leaves any tensor without a device (accelerate would fail later, or place it wrong)."""
    missing = unplaced(model, mapping)
    if missing:
        # One entry per whole block (`…layers.28.*`) so a map written for 28 of 40 layers reads at a glance.
        groups = list(dict.fromkeys(re.sub(r"^(.*\.layers\.\d+)\..*$", r"\1.*", n) for n in missing))
        shown = ", ".join(groups[:12]) + (f", … ({len(groups)} entries)" if len(groups) > 12 else "")
        shown += f" ({len(missing)} tensors)"
        raise ValueError(
            f"device map gives no device for: {shown} — map their modules (e.g. "
            "transformer.rotary_pos_emb for the inv_freq buffer) or use glmtune.infer.devicemap.device_map"
        )


def bytes_per_device(model: nn.Module, mapping: dict[str, int], dtype: torch.dtype | None = None) -> dict[int, int]:
    out: dict[int, int] = {}
    for name, device in mapping.items():
        out[device] = out.get(device, 0) + _nbytes(model.get_submodule(name), dtype)
    return out
