"""What an HF-native export of a GLM-4-0414 model needs from the family, as plain functions: the config.json
transformers and vLLM read, the weight-name table and the stop ids. The export itself is infer/'s one pipeline
(infer/hf_layout.py's GLM4_0414 layout: identity names, this hf_config, the vLLM split of the fused MLP adapter).

glmtune's module tree is transformers' (modeling.py), so a merged model's state_dict is already the checkpoint's
names and an adapter trained by glmtune loads in PEFT on transformers' Glm4ForCausalLM as it is
(tests/models/test_glm4_0414_reference.py).
"""

from __future__ import annotations

from .configuration import Glm4Config

ARCHITECTURE, MODEL_TYPE = "Glm4ForCausalLM", "glm4"
STOP_IDS = [151329, 151336, 151338]  # <|endoftext|>, <|user|>, <|observation|>: generation_config's eos


def hf_config(config: Glm4Config) -> dict:
    """config.json as transformers' Glm4Config reads it, in both layouts (4.51-4.57's top-level rope_theta and
    partial_rotary_factor; 5.x's rope_parameters, and `dtype` beside `torch_dtype`)."""
    dtype = config.torch_dtype if isinstance(config.torch_dtype, str) else str(config.torch_dtype).split(".")[-1]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": config.pad_token_id,
        "eos_token_id": config.eos_token_id,
        "bos_token_id": config.bos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def weight_names(config: Glm4Config) -> list[str]:
    """Every tensor of an HF-native GLM-4-0414 checkpoint, by name (the converter's table, transformers' names)."""
    layer = [
        "input_layernorm.weight",
        "post_self_attn_layernorm.weight",
        "post_attention_layernorm.weight",
        "post_mlp_layernorm.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
    ]
    layer += [
        f"self_attn.{p}_proj.{k}" for p in "qkv" for k in (("weight", "bias") if config.attention_bias else ("weight",))
    ]
    return ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers) for name in sorted(layer)
    ]


def check_weight_names(names, config: Glm4Config) -> tuple[list[str], list[str]]:
    """(missing, unexpected) tensor names of an export against weight_names."""
    wanted, got = set(weight_names(config)), set(names)
    return sorted(wanted - got), sorted(got - wanted)
