"""glmtune's own GLM-4 / ChatGLM3 models and tokenizers: official checkpoints, no remote code."""
from .configuration import RELEASED, GLMConfig, released_config
from .loading import build_meta_model, enable_checkpointing, load_config, load_model, make_tiny_checkpoint
from .modeling_glm4 import ChatGLMForConditionalGeneration, ChatGLMModel


def load_tokenizer(path):
    """Tokenizer of a checkpoint folder (GLM-4 tiktoken or ChatGLM3 SentencePiece), without remote code."""
    from .tokenizer_files import load_tokenizer as _load

    return _load(path)


__all__ = ["RELEASED", "GLMConfig", "released_config", "build_meta_model", "enable_checkpointing", "load_config",
           "load_model", "make_tiny_checkpoint", "load_tokenizer", "ChatGLMForConditionalGeneration", "ChatGLMModel"]
