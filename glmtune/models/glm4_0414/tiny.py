"""The tiny GLM-4-0414 checkpoint (`model=glm4_0414_tiny`): a random 2-layer model in the HF layout, with a chat
template of glmtune's own written in the shape of the 0414 checkpoints' (tools block, system turns, role tokens,
metadata for tool calls; the Z1 form drops `<think>...</think>` from the history and opens `<think>` in the
generation prompt). For tests and the demo; released checkpoints always bring their own template.

Head size 32: vLLM's CPU attention refuses 16 (the engine-parity tests serve this model). The tokenizer is trained by
tokenizer_files.write_tiny_fast_tokenizer (the tiny corpus lives there); the loader calls both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .configuration import Glm4Config
from .export import hf_config

# Same structure as GLM-4-9B-0414 (2 KV heads over 4 query heads, partial rotary, q/k/v bias, sandwich norms).
TINY_ARCH = dict(
    hidden_size=128, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, attention_bias=True, rms_norm_eps=1e-5,
    max_position_embeddings=8192, rope_theta=10000.0, partial_rotary_factor=0.5,
    # Wider than 0.02, for the same reason as the ChatGLM tiny model (loading.TINY_ARCH).
    initializer_range=0.1,
)  # fmt: skip

_TOOLS = (
    "{%- if tools -%}<|system|>{{ '\\n# 可用工具' }}{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{ '\\n\\n## ' ~ fn.name ~ '\\n\\n' }}{{ fn | tojson(indent=4, ensure_ascii=False) }}"
    "{{ '\\n在调用上述函数时，请使用 Json 格式表示调用的参数。' }}{%- endfor -%}{%- endif -%}"
    "{%- for m in messages if m.role == 'system' -%}<|system|>{{ '\\n' ~ m.content }}{%- endfor -%}"
)
_TURN = (
    "{%- set meta = m.metadata if m.metadata is defined and m.metadata else '' -%}"
    "<|{{ m.role }}|>{{ meta }}{{ '\\n' ~ content }}"
)
CHAT_TEMPLATE = (
    "[gMASK]<sop>" + _TOOLS + "{%- for m in messages if m.role != 'system' -%}"
    "{%- set content = m.content -%}" + _TURN + "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
CHAT_TEMPLATE_Z1 = (
    "[gMASK]<sop>" + _TOOLS + "{%- for m in messages if m.role != 'system' -%}"
    "{%- set content = m.content.split('</think>')[-1].strip() -%}" + _TURN + "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{ '\\n<think>' }}{%- endif -%}"
)


def write_model(out_dir: str | os.PathLike, vocab: int, eos: list[int], pad: int, seed: int = 0, **arch) -> Path:
    """config.json and model.safetensors of a random model for a tokenizer of `vocab` ids (padded to 64)."""
    from .modeling import Glm4ForCausalLM

    out = Path(out_dir)
    config = Glm4Config(
        **{**TINY_ARCH, **arch},
        vocab_size=-(-vocab // 64) * 64,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
        architectures=["Glm4ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Glm4ForCausalLM(config)
    with torch.no_grad():  # norms and biases away from their init, so a test sees each one
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    # config.json as transformers writes it for this class (export.hf_config): engines read the tiny model too.
    (out / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}, indent=2) + "\n")
    return out
