"""The ChatGLM architecture: GLM-4-9B-chat, GLM-4V-9B and ChatGLM3-6B under their official module names
(`transformer.encoder.layers.N.self_attention.query_key_value` ...): configuration, the decoder and its layers,
GLM-4V's EVA2-CLIP tower, the tiktoken (GLM-4) and SentencePiece (ChatGLM3) tokenizers, and their chat template.

May import: glmtune.config and models.kernels. Imported by the shared modules of glmtune.models (loading,
quantize, presets, generation, tokenizer_files), which pick the family from a checkpoint's config.json.
"""
