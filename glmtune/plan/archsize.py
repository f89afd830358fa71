"""Sizes that follow from the architecture alone: parameter counts of a GLM block, the GLM-4V tower and the
whole frozen model, and how much an image grows a row. The estimator (estimate.py) turns them into bytes."""

from __future__ import annotations

from ..models import GLMConfig

IMAGE_TOKENS = 1599  # GLM-4V at 1120 px: 1,602 image embeddings replace 3 placeholder tokens per image
VISION_LAYER_TOKENS = 6401  # ViT: 80x80 patches + CLS at 1120 px


def block_params(arch: GLMConfig) -> int:
    """One decoder block: QKV (fused, or GLM-4-0414's q/k/v_proj: the same shapes), output projection, SwiGLU MLP,
    and its RMSNorms (2; GLM-4-0414's "sandwich" block has 4)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    qkv_bias = arch.qkv_out if (arch.add_qkv_bias or arch.add_bias_linear) else 0
    bias = arch.add_bias_linear
    return (
        h * arch.qkv_out
        + qkv_bias
        + arch.num_attention_heads * arch.kv_channels * h
        + h * bias
        + h * 2 * f
        + 2 * f * bias
        + f * h
        + h * bias
        + getattr(arch, "norms_per_layer", 2) * h
    )


def vision_params(arch: GLMConfig) -> int:
    """EVA2-CLIP tower + GLU projector of GLM-4V (glm4-facts §6); 0 for text models."""
    v = arch.vision_config
    if not v:
        return 0
    w, i, h, f = v["hidden_size"], v["intermediate_size"], arch.hidden_size, arch.ffn_hidden_size
    layer = w * 3 * w + 3 * w + w * w + w + w * i + i + i * w + w + 4 * w
    embed = 3 * w * v["patch_size"] ** 2 + w + w + v["num_positions"] * w
    proj = w * h * 4 + h + h * h + 2 * h + 3 * h * f + 2 * h
    return v["num_hidden_layers"] * layer + embed + proj


def image_extra_tokens(arch: GLMConfig) -> int:
    """Sequence growth per image: boi + N patches + eoi replace 3 placeholders (1,599 at 1120 px); 0 for text."""
    v = arch.vision_config
    return (v["image_size"] // v["patch_size"] // 2) ** 2 - 1 if v else 0


def vision_working(arch: GLMConfig, images: int, e: int) -> int:
    """Transient bytes of the frozen tower's forward for `images` images. Nothing is kept for backward (no
    adapters in the tower, frozen weights, pixels need no grad), so only one ViT layer's tensors are live:
    its input, QKV [T, 3w], attention/dense/norm outputs and fc1 + GELU outputs [T, i] at T = patches + CLS
    per image (6,401), about 0.48 GB per image in bf16; plus the fp32 and bf16 pixels (15 MB + 7.5 MB)."""
    v = arch.vision_config
    tokens = images * ((v["image_size"] // v["patch_size"]) ** 2 + 1)
    pixels = images * 3 * v["image_size"] ** 2 * (4 + e)
    return tokens * e * (6 * v["hidden_size"] + 2 * v["intermediate_size"]) + pixels


def frozen_params(arch: GLMConfig) -> int:
    h, v = arch.hidden_size, arch.padded_vocab_size
    return arch.num_layers * block_params(arch) + 2 * v * h + h * arch.post_layer_norm + vision_params(arch)
