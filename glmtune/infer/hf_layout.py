"""`infer.merge_format=hf`: the HF-native layout of a GLM family, which transformers (>= 4.46 for `GlmForCausalLM`),
vLLM and SGLang load with no remote code — its config.json and its weight names — and what each engine calls the
layers an adapter may target.

A family is one `Layout` row in LAYOUTS, found by `layout_for(config, tokenizer)`:

    hf_config(config)          the HF config.json fields (RoPE as rope_theta + partial_rotary_factor)
    renames                    (regex on glmtune's parameter name, HF name) pairs, first match wins
    splits                     HF fused name -> its parts, each (name, rows of the fused matrix), e.g. glmtune's
                               query_key_value -> q_proj, k_proj, v_proj (split by rows; a LoRA B the same way,
                               its A shared: B·A split by rows is exactly [B_q·A; B_k·A; B_v·A])
    engine_splits[engine]      further splits an engine's adapter loader needs, on HF names (vLLM's native
                               Glm4ForCausalLM expands gate_up_proj to gate_proj + up_proj)
    engine_targets[engine]     the last name of every module that engine applies a LoRA to; anything else in an
                               adapter is refused at export (vLLM would refuse it at load, or apply nothing)
    base_is_hf                 the base folder is already this layout (GLM-4-0414): its non-weight files
                               (tokenizer.json, tokenizer_config.json and its chat template, generation_config.json,
                               README, ...) are the export's as the base ships them; glmtune writes what is missing

GLM-4-9B-chat is `GlmForCausalLM` (model_type glm): HF GlmMLP keeps dense_h_to_4h fused as gate_up_proj (gate
rows first, as glmtune's SwiGLU), and vLLM 0.32 serves it through its Transformers backend, which fuses
q/k/v into qkv_proj and accepts LoRAs on q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj (read from
vllm/model_executor/models/transformers/ and vllm/lora/, checked by tests/infer/test_engines.py). ChatGLM3 and GLM-4V
have no HF-native class: their exports stay `remote` (vLLM runs its own ChatGLM / GLM-4V models on them).

GLM-4-0414 / GLM-Z1 is `Glm4ForCausalLM` (model_type glm4) in its own checkpoints: glmtune's module tree has its
names, so `remote` and `hf` are one layout. vLLM 0.32 serves it with its native vllm/model_executor/models/glm4.py
(registry "Glm4ForCausalLM" -> glm4; tests/infer/test_engines.py loads it and checks the class), whose
packed_modules_mapping packs qkv_proj from q/k/v_proj and gate_up_proj from gate_proj + up_proj;
vllm/lora/worker_manager.py accepts an adapter's modules by the unpacked names only (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj: lora_model.py raises "expected target modules in ..." for gate_up_proj, and lm_head
is a ParallelLMHead it has no LoRA for), so an adapter for vLLM has the fused MLP LoRA split (engine_splits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import ConfigError
from ..models.glm4_0414.export import hf_config as glm4_0414_config

Split = Callable[[object], list[tuple[str, int]]]  # config -> [(part name, rows)]


def _qkv(config) -> list[tuple[str, int]]:
    hd = config.kv_channels
    return [
        ("q_proj", config.num_attention_heads * hd),
        ("k_proj", config.kv_groups * hd),
        ("v_proj", config.kv_groups * hd),
    ]


def _gate_up(config) -> list[tuple[str, int]]:
    ffn = getattr(config, "ffn_hidden_size", None) or config.intermediate_size
    return [("gate_proj", ffn), ("up_proj", ffn)]


def glm_config(config) -> dict:
    """config.json of GlmForCausalLM for a GLM-4-9B-chat-shaped GLMConfig (transformers' own conversion maps
    the same fields: rope_theta = 10000 * rope_ratio, the rotary half of each head as partial_rotary_factor 0.5)."""
    return {
        "architectures": ["GlmForCausalLM"],
        "model_type": "glm",
        "vocab_size": config.padded_vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "attention_bias": bool(config.add_qkv_bias),
        "attention_dropout": 0.0,
        "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": 10000.0 * config.rope_ratio,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "use_cache": True,
        "pad_token_id": config.pad_token_id,
        "eos_token_id": config.eos_token_id,
        "bos_token_id": None,
    }  # torch_dtype: the exported weights' (export.py)


def _glm_refusal(config) -> str | None:
    """Why a GLMConfig has no GlmForCausalLM twin (a GLM variant of the user's own), or None."""
    wanted = {
        "rmsnorm": True,
        "post_layer_norm": True,
        "apply_residual_connection_post_layernorm": False,
        "add_bias_linear": False,
        "original_rope": True,
    }
    off = [f"{k}={getattr(config, k, None)}" for k, v in wanted.items() if getattr(config, k, v) != v]
    return f"its config.json has {', '.join(off)}, which GlmForCausalLM does not implement" if off else None


@dataclass(frozen=True)
class Layout:
    name: str  # the family, as glmtune's exports and errors name it
    hf_config: Callable[[object], dict]
    renames: tuple[tuple[str, str], ...]
    splits: dict[str, Split] = field(default_factory=dict)
    engine_splits: dict[str, dict[str, Split]] = field(default_factory=dict)
    engine_targets: dict[str, frozenset] = field(default_factory=dict)
    refusal: Callable[[object], str | None] = lambda config: None
    base_is_hf: bool = False


# The Linears of an HF GLM block but the fused MLP input, which engines name differently; PEFT on transformers'
# model adapts any Linear, lm_head included.
_HF_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"})
_HF_PEFT = _HF_LINEARS | {"gate_up_proj", "lm_head"}
_LAYER = r"transformer\.encoder\.layers\.(\d+)\."
GLM = Layout(
    name="glm4",
    hf_config=glm_config,
    renames=(
        (r"transformer\.embedding\.word_embeddings\.", "model.embed_tokens."),
        (_LAYER + r"input_layernorm\.", r"model.layers.\1.input_layernorm."),
        (_LAYER + r"self_attention\.query_key_value\.", r"model.layers.\1.self_attn.query_key_value."),
        (_LAYER + r"self_attention\.dense\.", r"model.layers.\1.self_attn.o_proj."),
        (_LAYER + r"post_attention_layernorm\.", r"model.layers.\1.post_attention_layernorm."),
        (_LAYER + r"mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.gate_up_proj."),
        (_LAYER + r"mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.down_proj."),
        (r"transformer\.encoder\.final_layernorm\.", "model.norm."),
        (r"transformer\.output_layer\.", "lm_head."),
        (r"transformer\.rotary_pos_emb\.inv_freq$", ""),
    ),  # recomputed from rope_theta by every loader
    splits={"query_key_value": _qkv},
    engine_targets={"vllm": _HF_LINEARS | {"gate_up_proj"}, "peft": _HF_PEFT},
    refusal=_glm_refusal,
)
# The remote (official) layout: names unchanged. vLLM's ChatGLM / GLM-4V models take LoRAs on the four linear
# layers of a block (chatglm.py packed_modules_mapping is the identity for query_key_value, dense_h_to_4h);
# output_layer is a ParallelLMHead there, which vLLM's LoRA does not adapt.
REMOTE = Layout(
    name="remote",
    hf_config=lambda config: {},
    renames=(),
    engine_targets={"vllm": frozenset({"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"})},
)
# GLM-4-0414 / GLM-Z1: HF names already (identity renames), gate_up_proj fused in the checkpoint as in glmtune.
GLM4_0414 = Layout(
    name="glm4_0414",
    hf_config=glm4_0414_config,
    renames=((r"(.+)", r"\1"),),
    engine_splits={"vllm": {"gate_up_proj": _gate_up}},
    engine_targets={"vllm": _HF_LINEARS | {"gate_proj", "up_proj"}, "peft": _HF_PEFT},
    base_is_hf=True,
)
# A family plugs in with a Layout here, keyed by what family_of() returns for it.
LAYOUTS = {"glm4": GLM, "glm4_0414": GLM4_0414}
REMOTE_OF = {"glm4_0414": GLM4_0414}  # family -> its `remote` layout when that is not the official ChatGLM one
NOT_HF = {
    "chatglm3": "ChatGLM3 has no HF-native class in transformers",
    "glm4v": "GLM-4V-9B has no HF-native class in transformers",
}


def family_of(config, tokenizer) -> str:
    if getattr(config, "vision_config", None):
        return "glm4v"
    return tokenizer.family


def layout_for(fmt: str, config, tokenizer) -> Layout:
    """The Layout to export `config` in (`fmt`: remote | hf), or ConfigError saying why hf cannot be."""
    family = family_of(config, tokenizer)
    if fmt == "remote":
        return REMOTE_OF.get(family, REMOTE)
    layout = LAYOUTS.get(family)
    why = NOT_HF.get(family, f"no HF-native layout is known for {family}") if layout is None else layout.refusal(config)
    if why:
        raise ConfigError(
            f"infer.merge_format=hf: {why} — use infer.merge_format=remote (the official layout, "
            "which vLLM loads with its own ChatGLM model, no remote code)"
        )
    return layout


def rename(layout: Layout, name: str) -> str | None:
    """glmtune's parameter name (or a PEFT module path) in `layout`; "" = dropped; None = no rule (kept)."""
    for pattern, target in layout.renames:
        if re.match(pattern, name):
            return re.sub(pattern, target, name, count=1)
    return None


def split_rows(tensor: torch.Tensor, parts: list[tuple[str, int]], config) -> list[tuple[str, torch.Tensor]]:
    """A fused matrix (or bias, or LoRA B) cut into its parts by rows. Full multi-head attention stores
    query_key_value per head ([q_h | k_h | v_h], models/layers.py), so its rows are regrouped first."""
    if [p for p, _ in parts] == ["q_proj", "k_proj", "v_proj"] and not config.multi_query_attention:
        hd = config.kv_channels
        per_head = tensor.reshape(config.num_attention_heads, 3, hd, *tensor.shape[1:])
        tensor = torch.cat([per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3)])
    pieces = torch.split(tensor, [rows for _, rows in parts])
    return [(name, piece.contiguous()) for (name, _), piece in zip(parts, pieces)]


def hf_state_dict(layout: Layout, state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """glmtune's state dict (official names) in the layout's names, fused matrices split."""
    out = {}
    for name, tensor in state.items():
        new = rename(layout, name)
        if new == "":
            continue
        if new is None:
            raise ValueError(f"{name}: no {layout.name} HF name for this tensor")
        module, _, leaf = new.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in layout.splits:
            for part, piece in split_rows(tensor, layout.splits[last](config), config):
                out[f"{parent}.{part}.{leaf}"] = piece
        else:
            out[new] = tensor
    return out
