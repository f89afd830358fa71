"""Multi-GPU inference device maps on the meta device: every parameter and buffer placed, within budget,
whole GLM blocks per device, the vision tower on one device; incomplete maps are refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from glmtune.config.units import GIB
from glmtune.infer.devicemap import bytes_per_device, check_complete, device_map, units
from glmtune.models import build_meta_model, released_config


@pytest.fixture(scope="module", params=["glm4v_9b", "glm4_9b_chat", "chatglm3_6b"])
def meta(request):
    return request.param, build_meta_model(released_config(request.param), torch.bfloat16)


def _device_of(name: str, mapping: dict[str, int]) -> int:
    parts = name.split(".")
    return next(mapping[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mapping)


@pytest.mark.parametrize("gpus, gib", [(2, 23.6), (3, 23.6), (4, 15.0), (2, 39.4), (8, 10.0)])
def test_every_tensor_placed_within_budget_whole_blocks(meta, gpus, gib):
    name, model = meta
    budgets = [gib * GIB] * gpus
    total = sum(u.nbytes for u in units(model))
    if total > sum(budgets):
        with pytest.raises(ValueError, match="weights need"):
            device_map(model, budgets)
        return
    mapping = device_map(model, budgets)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert "transformer.rotary_pos_emb.inv_freq" in dict(model.named_buffers())
    devices = {n: _device_of(n, mapping) for n, _ in tensors}  # raises StopIteration if one is unplaced
    assert set(devices.values()) <= set(range(gpus))
    for device, used in bytes_per_device(model, mapping).items():
        assert used <= budgets[device]
    # Whole blocks: every tensor of a block on the block's device; the vision tower on one device.
    by_block: dict[str, set[int]] = {}
    for n, d in devices.items():
        m = re.match(r"(transformer\.encoder\.layers\.\d+|transformer\.vision)\.", n)
        if m:
            by_block.setdefault(m.group(1), set()).add(d)
    assert all(len(ds) == 1 for ds in by_block.values())
    assert ("transformer.vision" in by_block) == (name == "glm4v_9b")
    # Blocks run in order, so devices only ever increase along the layers (one hop per boundary).
    layer_devices = [mapping[f"transformer.encoder.layers.{i}"] for i in range(model.config.num_layers)]
    assert layer_devices == sorted(layer_devices)
    if gpus > 1:
        assert len(set(mapping.values())) > 1  # really spread, not everything on GPU 0


def test_glm4v_on_two_3090s_balances_and_keeps_the_tower_whole():
    model = build_meta_model(released_config("glm4v_9b"), torch.bfloat16)
    mapping = device_map(model, [23.6 * GIB] * 2, reserve=2 * GIB)
    used = bytes_per_device(model, mapping)
    assert abs(used[0] - used[1]) < 1.5 * GIB  # 25.9 GiB split roughly in half
    assert mapping["transformer.vision"] == mapping["transformer.embedding"] == 0


def test_incomplete_maps_are_refused_by_name():
    model = build_meta_model(released_config("glm4_9b_chat"), torch.bfloat16)
    # ChatGLM3's old auto_configure_device_map: 28 layers hard-coded and no rotary_pos_emb entry.
    old = {
        "transformer.embedding.word_embeddings": 0,
        "transformer.encoder.final_layernorm": 0,
        "transformer.output_layer": 0,
        **{f"transformer.encoder.layers.{i}": i // 14 for i in range(28)},
    }
    with pytest.raises(ValueError, match=r"transformer\.rotary_pos_emb\.inv_freq.*layers\.28\."):
        check_complete(model, old)
    with pytest.raises(ValueError, match="does not fit|weights need"):
        device_map(model, [8 * GIB, 8 * GIB])


def test_peft_wrapped_model_gets_prefixed_keys():
    from peft import LoraConfig, get_peft_model

    from glmtune.models import load_model
    from glmtune.models.presets import ensure_tiny

    model = get_peft_model(
        load_model(ensure_tiny("glm4v")), LoraConfig(r=4, target_modules=r"^(?!.*\.vision\.).*\.query_key_value$")
    )
    mapping = device_map(model, [1 * GIB, 1 * GIB])
    assert all(k.startswith("base_model.model.transformer.") for k in mapping)
    check_complete(model, mapping)
