"""Load official GLM checkpoint folders natively, and write tiny random ones.

A checkpoint folder holds config.json plus `model*.safetensors` or `pytorch_model*.bin` (sharded with an
index json or not) and tokenizer files. config.json's `model_type` picks the family: `glm4` (GLM-4-0414,
GLM-Z1-0414: models/glm4_0414), anything else the ChatGLM architecture (GLM-4-9B-chat, GLM-4V, ChatGLM3:
models/chatglm). glmtune reads the weights into its own model class and never imports the Python files the
folder ships (`modeling_chatglm.py`, ...); `trust_remote_code=True` is an explicit opt-in that does run them.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch

from ..config import ConfigError, read_json_object
from .chatglm.configuration import GLM4V_VISION, GLMConfig
from .weightfiles import load_error, reading_error

# The model code (and transformers' modeling, accelerate) is imported where a model is built: reading a
# config.json or checking weight files, as mode=plan and the data stage do, needs none of it.

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_config(path: str | os.PathLike) -> GLMConfig:
    """The architecture in a folder's config.json: a Glm4Config (model_type glm4) or a GLMConfig (ChatGLM)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file}: no config.json — point model.path at a GLM-4/ChatGLM3 checkpoint folder"
        )
    data = read_json_object(config_file, str(config_file), "restore the checkpoint's config.json (re-download it)")
    if data.get("model_type") != "glm4":
        return GLMConfig(**data)
    from .glm4_0414.configuration import Glm4Config

    config = Glm4Config(**data)
    problem = config.check()
    if problem:
        raise ConfigError(f"{config_file}: {problem}")
    return config


def model_class(config) -> type:
    """glmtune's causal LM class for an architecture (load_config's answer)."""
    if getattr(config, "model_type", None) == "glm4":
        from .glm4_0414.modeling import Glm4ForCausalLM

        return Glm4ForCausalLM
    from .chatglm.modeling import ChatGLMForConditionalGeneration

    return ChatGLMForConditionalGeneration


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """Load a checkpoint folder into glmtune's model.

    dtype None keeps the checkpoint's own dtype (config.json `torch_dtype`, bf16 for GLM-4).
    device "meta" builds the model from config.json alone, without reading any weight file: the planner
    and device maps use it to count and place parameters of a 9B model in milliseconds.
    """
    dtype = _as_dtype(dtype)
    if trust_remote_code:
        if load_config(path).model_type == "glm4":
            raise ConfigError(
                f"{path}: model.trust_remote_code=true, but a GLM-4-0414 checkpoint ships no remote code "
                "(transformers >= 4.51.3 has its class) — leave model.trust_remote_code=false"
            )
        return _load_remote_code(path, dtype, device)
    config = load_config(path)
    if str(device) == "meta":
        return build_meta_model(config, dtype)
    from transformers.integrations import is_deepspeed_zero3_enabled

    try:
        model, info = model_class(config).from_pretrained(
            str(path),
            config=config,
            torch_dtype=dtype or "auto",
            output_loading_info=True,
            # ZeRO-3 builds the model inside deepspeed.zero.Init, which low_cpu_mem_usage would bypass.
            low_cpu_mem_usage=not is_deepspeed_zero3_enabled(),
        )
    except (OSError, ValueError, pickle.UnpicklingError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not reading_error(err):
            raise  # not the files: e.g. a collective of ZeRO-3's partitioned init, reported as a crash with its log
        raise ConfigError(load_error(path, err)) from None
    # With low_cpu_mem_usage, transformers 4.40 leaves a missing weight on the meta device without listing it.
    missing = info["missing_keys"] or [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ConfigError(
            f"{path}: checkpoint lacks {len(missing)} weights, e.g. "
            f"{', '.join(missing[:3])} — is it a complete GLM-4/ChatGLM3 checkpoint?"
        )
    model.config.name_or_path = str(path)
    return model.to(device) if device is not None else model


def build_meta_model(config: GLMConfig, dtype: torch.dtype | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class(config)(config)
    return model.to(dtype) if dtype is not None else model


def _load_remote_code(path, dtype, device):
    """Opt-in path: the folder's own modeling code (what `trust_remote_code=True` means everywhere in HF)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), trust_remote_code=True, torch_dtype=dtype or "auto", empty_init=False
    )
    return model.to(device) if device is not None else model


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = True) -> int:
    """Turn gradient checkpointing on and make sure it engaged; returns how many modules use it.

    The June-2024 reference code overrides `gradient_checkpointing_enable()` with a no-op, so after the HF
    call every module that exposes the `gradient_checkpointing` flag (the reference's GLMTransformer does)
    is set directly, and a model with none raises instead of silently training without it.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    flagged = [m for m in base.modules() if hasattr(m, "gradient_checkpointing")]
    for module in flagged:
        module.gradient_checkpointing = True
    if not flagged:
        raise RuntimeError("gradient checkpointing did not engage: no module exposes a gradient_checkpointing flag")
    return len(flagged)


# Small enough to train for the demo on 2 CPU cores in seconds, with the real model's structure:
# GQA with 2 KV groups, partial rotary, fused QKV with bias, SwiGLU, untied output layer.
TINY_ARCH = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=172, kv_channels=16, num_attention_heads=4,
    multi_query_attention=True, multi_query_group_num=2, add_qkv_bias=True, add_bias_linear=False,
    rmsnorm=True, post_layer_norm=True, apply_residual_connection_post_layernorm=False,
    # Wider than the usual 0.02: at hidden 64 that would cap logits near +-1.3, so no fine-tune
    # could move the loss far from ln(vocab); 0.1 gives a trained model's logit range.
    initializer_range=0.1,
)  # fmt: skip
_FAMILY = {
    "glm4": dict(rope_ratio=500.0, layernorm_epsilon=1.5625e-07, seq_length=8192),
    "chatglm3": dict(rope_ratio=1.0, layernorm_epsilon=1e-05, seq_length=8192),
    # glm-4v-9b has no rope_ratio (default 1). The tower keeps the real structure (GLM4V_VISION: post-norm ViT,
    # conv 2x2, GLU) at 56 px: 4x4 patches of 14 px -> conv -> 2x2 = 4 image tokens, 6 embeddings with boi/eoi.
    "glm4v": dict(
        rope_ratio=1.0,
        layernorm_epsilon=1.5625e-07,
        seq_length=8192,
        vision_config=dict(
            GLM4V_VISION, num_hidden_layers=2, hidden_size=32, num_heads=4, intermediate_size=64, num_positions=17,
            image_size=56,
        ),
    ),
}  # fmt: skip


# The GLM-4-0414 family's tiny checkpoints (models/glm4_0414/tiny.py): its template, or GLM-Z1's.
HF_FAMILIES = ("glm4_0414", "glmz1_0414")


def tiny_recipe(family: str) -> list:
    """What a tiny checkpoint of `family` is built from, for presets.ensure_tiny's folder name."""
    if family in HF_FAMILIES:
        from .glm4_0414 import tiny

        return [tiny.TINY_ARCH, tiny.CHAT_TEMPLATE_Z1 if family == "glmz1_0414" else tiny.CHAT_TEMPLATE]
    return [TINY_ARCH, _FAMILY[family]]


def make_tiny_checkpoint(out_dir: str | os.PathLike, family: str = "glm4", seed: int = 0, **arch) -> Path:
    """Write a small random checkpoint in the official layout: config.json, model.safetensors, tokenizer files.

    `arch` overrides TINY_ARCH (e.g. hidden_size=768, num_layers=12 for a ~100M-parameter model), or for the
    GLM-4-0414 families glm4_0414/tiny.TINY_ARCH (HF names: num_key_value_heads=4, attention_bias=False, ...).
    """
    from .chatglm.modeling import ChatGLMForConditionalGeneration
    from .tokenizer_files import load_tokenizer, write_tiny_fast_tokenizer, write_tiny_tokenizer

    if family not in (*_FAMILY, *HF_FAMILIES):
        raise ValueError(f"unknown family {family!r}; use one of {', '.join((*_FAMILY, *HF_FAMILIES))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family in HF_FAMILIES:
        from .glm4_0414 import tiny

        vocab = write_tiny_fast_tokenizer(out, tiny_recipe(family)[1])
        tok = load_tokenizer(out)
        tiny.write_model(out, vocab, list(tok.stop_token_ids), tok.pad_token_id, seed, **arch)
        (out / "glmtune_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
        return out
    vocab = write_tiny_tokenizer(out, family)
    tok = load_tokenizer(out)
    config = GLMConfig(
        **{**TINY_ARCH, **_FAMILY[family], **arch},
        padded_vocab_size=-(-vocab // 64) * 64,  # padded like the real vocabularies
        eos_token_id=list(tok.stop_token_ids),
        pad_token_id=tok.pad_token_id,
        **(
            dict(boi_token_id=tok.get_command("<|begin_of_image|>"), eoi_token_id=tok.get_command("<|end_of_image|>"))
            if family == "glm4v"
            else {}
        ),
        torch_dtype="float32",
        architectures=["ChatGLMForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = ChatGLMForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "glmtune_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return out
