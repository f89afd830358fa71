"""What an HF-native export of a GLM-4-0414 model needs, as plain functions the export dispatch (infer/) calls:
the config.json transformers and vLLM read, the weight-name table, the stop ids, and the vLLM form of an adapter.

glmtune's module tree is transformers' (modeling.py), so a merged model's state_dict is already the checkpoint's
names and an adapter trained by glmtune loads in PEFT on transformers' Glm4ForCausalLM as it is
(tests/models/test_glm4_0414_reference.py). vLLM is the exception: its Glm4ForCausalLM packs `gate_up_proj` from
`gate_proj` + `up_proj` (vllm/model_executor/models/glm4.py `packed_modules_mapping`) and accepts adapter modules
by those unpacked names only (vllm/lora/worker_manager.py builds the accepted set from the mapping;
lora/lora_model.py raises "expected target modules in ... but received ..." for `gate_up_proj`). An adapter on the
fused Linear is split for it exactly: W [2f, h] = [W_gate; W_up] and the LoRA update B A [2f, h] = [B_gate A; B_up A],
so gate_proj and up_proj each take A unchanged and their rows of B (gate first, as `chunk(2)` splits the output).
"""
from __future__ import annotations

import copy
import re

import torch

from .configuration import Glm4Config

ARCHITECTURE, MODEL_TYPE = "Glm4ForCausalLM", "glm4"
STOP_IDS = [151329, 151336, 151338]  # <|endoftext|>, <|user|>, <|observation|>: generation_config's eos
_FUSED = "gate_up_proj"
_SPLIT = ("gate_proj", "up_proj")  # vLLM's names, in the fused Linear's row order


def hf_config(config: Glm4Config) -> dict:
    """config.json as transformers' Glm4Config reads it, in both layouts (4.51-4.57's top-level rope_theta and
    partial_rotary_factor; 5.x's rope_parameters, and `dtype` beside `torch_dtype`)."""
    dtype = config.torch_dtype if isinstance(config.torch_dtype, str) else str(config.torch_dtype).split(".")[-1]
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "hidden_act": config.hidden_act, "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout, "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
        "tie_word_embeddings": False, "use_cache": True, "pad_token_id": config.pad_token_id,
        "eos_token_id": config.eos_token_id, "bos_token_id": config.bos_token_id,
        "torch_dtype": dtype, "dtype": dtype,
    }


def weight_names(config: Glm4Config) -> list[str]:
    """Every tensor of an HF-native GLM-4-0414 checkpoint, by name (the converter's table, transformers' names)."""
    layer = ["input_layernorm.weight", "post_self_attn_layernorm.weight", "post_attention_layernorm.weight",
             "post_mlp_layernorm.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    layer += [f"self_attn.{p}_proj.{k}" for p in "qkv" for k in (("weight", "bias") if config.attention_bias
                                                                 else ("weight",))]
    return (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
            + [f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers) for name in sorted(layer)])


def check_weight_names(names, config: Glm4Config) -> tuple[list[str], list[str]]:
    """(missing, unexpected) tensor names of an export against weight_names."""
    wanted, got = set(weight_names(config)), set(names)
    return sorted(wanted - got), sorted(got - wanted)


def split_fused_mlp_lora(weights: dict[str, torch.Tensor], adapter_config: dict
                         ) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT adapter (its safetensors tensors and adapter_config.json) in the form vLLM accepts for this class:
    each `...mlp.gate_up_proj.lora_A/lora_B` becomes gate_proj and up_proj (A copied, B split by rows), and
    target_modules, rank_pattern and alpha_pattern name them instead. Every other tensor is kept as it is.
    ValueError for what no split can give vLLM: DoRA (vLLM has none) and a LoRA bias on the fused Linear."""
    if adapter_config.get("use_dora") or any("lora_magnitude_vector" in k for k in weights):
        raise ValueError("the adapter is DoRA (lora.use_dora=true), which vLLM does not run — train it without "
                         "DoRA, or serve the merged model")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        match = re.fullmatch(rf"(.*\.){_FUSED}\.(lora_A|lora_B)(\.[^.]+)?\.weight", name)
        if match is None:
            if f".{_FUSED}." in name:
                raise ValueError(f"{name}: a tensor of the fused {_FUSED} that only its LoRA A and B can be split "
                                 "for vLLM")
            out[name] = tensor
            continue
        prefix, kind, adapter = match.group(1), match.group(2), match.group(3) or ""
        parts = [tensor, tensor] if kind == "lora_A" else list(tensor.chunk(2, dim=0))  # B: gate rows, up rows
        if kind == "lora_B" and parts[0].shape != parts[1].shape:
            raise ValueError(f"{name}: {tuple(tensor.shape)} does not split into equal gate and up halves")
        for split, part in zip(_SPLIT, parts):
            out[f"{prefix}{split}.{kind}{adapter}.weight"] = part.contiguous().clone()
    config = copy.deepcopy(adapter_config)
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regex: vLLM reads the tensors' names, not this; widen it to the split names
        config["target_modules"] = targets.replace(_FUSED, "|".join(_SPLIT))
    elif targets is not None:
        config["target_modules"] = sorted({s for t in targets for s in (_SPLIT if t == _FUSED else (t,))})
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        config[key] = {k2: v for k, v in pattern.items()
                       for k2 in ([k.replace(_FUSED, s) for s in _SPLIT] if _FUSED in k else [k])}
    return out, config
