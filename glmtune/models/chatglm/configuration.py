"""GLM-4 / ChatGLM3 configuration: the official `config.json` fields, and the released models' values.

The three released checkpoints share one decoder block; what differs is in the config:
glm-4-9b-chat (40 layers, vocab 151,552, RoPE base 10000*500), glm-4v-9b (same language model
plus a vision tower), chatglm3-6b (28 layers, vocab 65,024, RoPE base 10000).
`RELEASED` holds those values so the planner and device maps work without any download.
Sources: ../shared/reference/glm4-facts.md §1-§2 (third-party copies of the HF config.json files).
"""

from __future__ import annotations

from transformers import PretrainedConfig

# Keys of GLM-4V only; a text checkpoint's config.json leaves them out (GLMConfig.to_dict, infer/export.py).
TEXT_MODEL_DROPS = ("vision_config", "boi_token_id", "eoi_token_id")


class GLMConfig(PretrainedConfig):
    # "chatglm" is what the official config.json says; transformers 4.40.2 does not know it, which is
    # fine because glmtune never goes through the Auto classes.
    model_type = "chatglm"
    attribute_map = {"num_hidden_layers": "num_layers", "vocab_size": "padded_vocab_size"}

    # The official config.json's keys, defaults glm-4-9b-chat's (RELEASED below), in its order; rows by hand.
    def __init__(
        self, num_layers: int = 40, padded_vocab_size: int = 151552, hidden_size: int = 4096,
        ffn_hidden_size: int = 13696, kv_channels: int = 128, num_attention_heads: int = 32, seq_length: int = 131072,
        hidden_dropout: float = 0.0, attention_dropout: float = 0.0, layernorm_epsilon: float = 1.5625e-07,
        rmsnorm: bool = True, apply_residual_connection_post_layernorm: bool = False, post_layer_norm: bool = True,
        add_bias_linear: bool = False, add_qkv_bias: bool = True, multi_query_attention: bool = True,
        multi_query_group_num: int = 2, rope_ratio: float = 1.0, apply_query_key_layer_scaling: bool = True,
        attention_softmax_in_fp32: bool = True, fp32_residual_connection: bool = False, original_rope: bool = True,
        vision_config: dict | None = None, boi_token_id: int | None = None, eoi_token_id: int | None = None,
        use_cache: bool = True, **kwargs,
    ):  # fmt: skip
        self.num_layers = num_layers
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.kv_channels = kv_channels
        self.num_attention_heads = num_attention_heads
        self.seq_length = seq_length
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.layernorm_epsilon = layernorm_epsilon
        self.rmsnorm = rmsnorm
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.post_layer_norm = post_layer_norm
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias
        self.multi_query_attention = multi_query_attention
        self.multi_query_group_num = multi_query_group_num
        self.rope_ratio = rope_ratio
        self.apply_query_key_layer_scaling = apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = attention_softmax_in_fp32
        self.fp32_residual_connection = fp32_residual_connection
        self.original_rope = original_rope
        self.vision_config = vision_config
        self.boi_token_id = boi_token_id
        self.eoi_token_id = eoi_token_id
        self.use_cache = use_cache
        # The official files default to tie_word_embeddings=False (separate output_layer).
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def to_dict(self) -> dict:
        """config.json as written: a text model carries no vision keys at all. Engines read the presence of
        `vision_config` (even null) as "this is GLM-4V": vLLM's text ChatGLM then refuses to load the folder."""
        out = super().to_dict()
        if out.get("vision_config") is None:
            for key in TEXT_MODEL_DROPS:
                out.pop(key, None)
        return out

    @property
    def kv_groups(self) -> int:
        """KV heads: multi_query_group_num under GQA, else one per attention head."""
        return self.multi_query_group_num if self.multi_query_attention else self.num_attention_heads

    @property
    def qkv_out(self) -> int:
        return self.kv_channels * (self.num_attention_heads + 2 * self.kv_groups)

    def lora_modules(self, names) -> tuple[str, ...]:
        """The modules LoRA adapts for lora.target_modules: ChatGLM's names are this family's own."""
        return tuple(names)


# The decoder block all three released checkpoints share (facts §1-§2); what differs is depth, vocabulary, context,
# RoPE base, eps and dtype.
_BLOCK = dict(
    hidden_size=4096, ffn_hidden_size=13696, kv_channels=128, num_attention_heads=32,
    multi_query_attention=True, multi_query_group_num=2, add_qkv_bias=True, add_bias_linear=False,
    rmsnorm=True, post_layer_norm=True, apply_residual_connection_post_layernorm=False, tie_word_embeddings=False,
)  # fmt: skip
_GLM4_COMMON = dict(
    _BLOCK, num_layers=40, padded_vocab_size=151552, layernorm_epsilon=1.5625e-07, torch_dtype="bfloat16",
    eos_token_id=[151329, 151336, 151338], pad_token_id=151329,
)  # fmt: skip

# glm-4v-9b's vision_config, from its config.json (facts §1): depth and widths, then the image and its patches.
GLM4V_VISION = dict(
    num_hidden_layers=63, hidden_size=1792, num_heads=16, intermediate_size=15360, hidden_act="gelu",
    image_size=1120, patch_size=14, in_channels=3, num_positions=6401, scaling_factor=8,
    dropout_prob=0.0, layer_norm_eps=1e-06,
)  # fmt: skip

RELEASED: dict[str, dict] = {
    "glm4_9b_chat": dict(_GLM4_COMMON, seq_length=131072, rope_ratio=500),
    # Base model: 8K context per the README; rope_ratio 1 is the config default [unverified].
    "glm4_9b": dict(_GLM4_COMMON, seq_length=8192, rope_ratio=1),
    "glm4v_9b": dict(
        _GLM4_COMMON, seq_length=2048, vision_config=GLM4V_VISION, boi_token_id=151339, eoi_token_id=151340
    ),
    "chatglm3_6b": dict(
        _BLOCK, num_layers=28, padded_vocab_size=65024, seq_length=8192, layernorm_epsilon=1e-05,
        torch_dtype="float16", eos_token_id=2, pad_token_id=0,
    ),
}  # fmt: skip


def released_config(name: str) -> GLMConfig:
    """Architecture of a released model by preset name, without any download."""
    if name not in RELEASED:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(RELEASED)}")
    return GLMConfig(**RELEASED[name])
