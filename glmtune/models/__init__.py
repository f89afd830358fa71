"""Models: glmtune's own GLM models and tokenizers, loaded from official checkpoints with no remote code. One folder
per architecture family (`chatglm/`: GLM-4-9B-chat, GLM-4V-9B, ChatGLM3-6B; `glm4_0414/`: GLM-4-0414 and
GLM-Z1-0414), the kernels every family's decoder shares (`kernels/`: attention, Ulysses, masks, per-document
attention, the tiled MLP, the loss), and beside them what training and inference share whatever the family:
checkpoint loading (`loading.py`, the weight files checked first in `weightfiles.py`), quantized loading
(`quantize.py`), the presets (`presets.py`), generation (`generation.py`, `kvcache.py`), a folder's tokenizer
(`tokenizer_files.py`) and the identity of the base checkpoint an adapter was trained on (`identity.py`).

May import: glmtune.config. The names below load their module on first use (PEP 562): `mode=plan` reads an
architecture (GLMConfig) and must not pay for the model code, the tokenizers or accelerate.
"""

import importlib

_WHERE = {
    "RELEASED": "chatglm.configuration",
    "GLMConfig": "chatglm.configuration",
    "Glm4Config": "glm4_0414.configuration",
    "released_config": "presets",
    "build_meta_model": "loading",
    "enable_checkpointing": "loading",
    "load_config": "loading",
    "load_model": "loading",
    "make_tiny_checkpoint": "loading",
    "ChatGLMForConditionalGeneration": "chatglm.modeling",
    "ChatGLMModel": "chatglm.modeling",
    "Glm4ForCausalLM": "glm4_0414.modeling",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def load_tokenizer(path, thinking: str = "keep"):
    """Tokenizer of a checkpoint folder (GLM-4-0414 tokenizer.json, GLM-4 tiktoken or ChatGLM3 SentencePiece),
    without remote code; `thinking`: data.thinking (GLM-Z1's template)."""
    from .tokenizer_files import load_tokenizer as _load

    return _load(path, thinking)


__all__ = [*_WHERE, "load_tokenizer"]
