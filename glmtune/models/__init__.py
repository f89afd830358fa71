"""glmtune's own GLM-4 / ChatGLM3 models and tokenizers: official checkpoints, no remote code. Also what training
and inference share: the chat template (`template.py`), generation (`generation.py`) and the identity of the base
checkpoint an adapter was trained on (`identity.py`).

The names below load their module on first use (PEP 562): `mode=plan` reads an architecture (GLMConfig) and
must not pay for the model code, the tokenizers or accelerate.
"""
import importlib

_WHERE = {"RELEASED": "configuration", "GLMConfig": "configuration", "released_config": "configuration",
          "build_meta_model": "loading", "enable_checkpointing": "loading", "load_config": "loading",
          "load_model": "loading", "make_tiny_checkpoint": "loading",
          "ChatGLMForConditionalGeneration": "modeling_glm4", "ChatGLMModel": "modeling_glm4"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def load_tokenizer(path):
    """Tokenizer of a checkpoint folder (GLM-4 tiktoken or ChatGLM3 SentencePiece), without remote code."""
    from .tokenizer_files import load_tokenizer as _load

    return _load(path)


__all__ = [*_WHERE, "load_tokenizer"]
