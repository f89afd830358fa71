"""GLM-4-0414 / GLM-Z1-0414 configuration: transformers' `Glm4Config` fields (`model_type: glm4`), read from the
checkpoint's own config.json, and the released models' values.

Every value comes from config.json: `attention_bias` (true for 9B, false for 32B), `head_dim`, `num_key_value_heads`,
`rms_norm_eps`, `max_position_embeddings`, and the rotary embedding in either layout transformers writes: 4.51-4.57's
top-level `rope_theta` + `partial_rotary_factor`, or 5.x's `rope_parameters: {rope_type, rope_theta,
partial_rotary_factor}` (5.x also writes `dtype` for `torch_dtype`). A key a config.json lacks takes transformers'
own `Glm4Config` default, so both read a folder alike: that is not the shipped values (eps 1.5625e-7 and 131,072
positions by default; the released configs say 1e-5 and 32,768). Only the default rotary type is implemented:
another `rope_type` (scaled RoPE) is refused by `check`, not silently ignored.

The ChatGLM names the planner reads (num_layers, padded_vocab_size, ffn_hidden_size, kv_channels, kv_groups,
qkv_out, add_qkv_bias, ...) are aliases of the HF fields, so plan/ sizes this family with the terms it has, plus
`norms_per_layer` (4: the "sandwich" norms) and `split_qkv` (q/k/v_proj are three Linears, each with its own LoRA).
Sources: ../shared/reference/glm-0414-engines-scaleout-2026-11.md §1.1-§1.3.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# transformers' Glm4Config defaults, for keys a config.json leaves out (see above).
_DEFAULT_THETA, _DEFAULT_PARTIAL = 10000.0, 0.5


class Glm4Config(PretrainedConfig):
    model_type = "glm4"
    attribute_map = {
        "num_layers": "num_hidden_layers",
        "padded_vocab_size": "vocab_size",
        "ffn_hidden_size": "intermediate_size",
        "kv_channels": "head_dim",
        "multi_query_group_num": "num_key_value_heads",
        "seq_length": "max_position_embeddings",
        "layernorm_epsilon": "rms_norm_eps",
    }

    # transformers' Glm4Config keys, defaults GLM-4-9B-0414's, in transformers' order; rows by hand.
    def __init__(
        self, vocab_size: int = 151552, hidden_size: int = 4096, intermediate_size: int = 13696,
        num_hidden_layers: int = 40, num_attention_heads: int = 32, num_key_value_heads: int = 2, head_dim: int = 128,
        hidden_act: str = "silu", attention_dropout: float = 0.0, max_position_embeddings: int = 131072,
        initializer_range: float = 0.02, rms_norm_eps: float = 1.5625e-07, use_cache: bool = True,
        tie_word_embeddings: bool = False, rope_theta: float | None = None,
        partial_rotary_factor: float | None = None, rope_parameters: dict | None = None,
        rope_scaling: dict | None = None, attention_bias: bool = True, pad_token_id: int | None = 151329,
        eos_token_id=None, bos_token_id: int | None = None, **kwargs,
    ):  # fmt: skip
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim, self.hidden_act = num_key_value_heads, head_dim, hidden_act
        self.attention_dropout, self.max_position_embeddings = attention_dropout, max_position_embeddings
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.attention_bias = attention_bias
        params = dict(rope_parameters or {})
        self.rope_theta = float(params.get("rope_theta", rope_theta if rope_theta is not None else _DEFAULT_THETA))
        self.partial_rotary_factor = float(
            params.get(
                "partial_rotary_factor",
                partial_rotary_factor if partial_rotary_factor is not None else _DEFAULT_PARTIAL,
            )
        )
        # Kept as read, for `check` and for a config.json written back unchanged (exports copy the base's file).
        self.rope_parameters = rope_parameters
        self.rope_scaling = rope_scaling
        dtype = kwargs.pop("dtype", None)  # transformers 5.x's name for torch_dtype
        if kwargs.get("torch_dtype") is None and dtype is not None:
            kwargs["torch_dtype"] = dtype
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id if eos_token_id is not None else [151329, 151336, 151338],
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def check(self) -> str | None:
        """Why glmtune cannot run this configuration as the reference does, or None."""
        kinds = {
            k
            for k in (
                (self.rope_parameters or {}).get("rope_type"),
                (self.rope_scaling or {}).get("rope_type"),
                (self.rope_scaling or {}).get("type"),
            )
            if k not in (None, "default")
        }
        if kinds:
            return (
                f"rope_type {sorted(kinds)[0]!r}: glmtune implements the default (unscaled) rotary embedding of "
                "GLM-4-0414 only"
            )
        if self.hidden_act != "silu":
            return f"hidden_act {self.hidden_act!r}: GLM-4-0414's MLP is SwiGLU (silu)"
        if self.tie_word_embeddings:
            return "tie_word_embeddings=true: GLM-4-0414 has a separate lm_head"
        if self.num_attention_heads % self.num_key_value_heads:
            return f"{self.num_attention_heads} attention heads do not split into {self.num_key_value_heads} KV heads"
        return None

    # --- the ChatGLM names the planner reads (plan/archsize.py, estimate.py) ---
    family = "glm4_0414"
    norms_per_layer = 4  # input, post_self_attn, post_attention, post_mlp
    split_qkv = True  # q_proj, k_proj, v_proj: three Linears, each with its own LoRA and saved input
    multi_query_attention = True  # blocked q | k | v rows (GQA) in ChatGLM's terms
    add_bias_linear = False  # o_proj, gate_up_proj, down_proj have none
    post_layer_norm = True
    rmsnorm = True
    vision_config = None

    @property
    def kv_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def qkv_out(self) -> int:
        return self.head_dim * (self.num_attention_heads + 2 * self.num_key_value_heads)

    @property
    def add_qkv_bias(self) -> bool:
        return self.attention_bias

    def lora_modules(self, names) -> tuple[str, ...]:
        """The modules LoRA adapts for lora.target_modules: HF names as they are, and the ChatGLM names of the lora
        presets (lora=default: query_key_value; all_linear) translated to the Linears that take their place."""
        return tuple(dict.fromkeys(m for name in names for m in CHATGLM_NAMES.get(name, (name,))))

    @property
    def rotary_dim(self) -> int:
        """Dims of each head the rotary embedding turns (64 of 128 in the released models)."""
        return int(self.head_dim * self.partial_rotary_factor)


# ChatGLM's layer names -> this family's modules (the official GLM-4-0414 LoRA recipe targets q, k and v_proj).
CHATGLM_NAMES = {
    "query_key_value": ("q_proj", "k_proj", "v_proj"),
    "dense": ("o_proj",),
    "dense_h_to_4h": ("gate_up_proj",),
    "dense_4h_to_h": ("down_proj",),
    "output_layer": ("lm_head",),
}

_COMMON = dict(
    vocab_size=151552,
    num_key_value_heads=2,
    head_dim=128,
    hidden_act="silu",
    attention_dropout=0.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-05,
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338],
    architectures=["Glm4ForCausalLM"],
)
_9B = dict(
    _COMMON,
    hidden_size=4096,
    intermediate_size=13696,
    num_hidden_layers=40,
    num_attention_heads=32,
    attention_bias=True,
)
# 48 q heads over 2 KV heads reproduces the 32.56 B parameters reported for it (8 KV heads would give 33.14 B,
# GLM-Z1-Rumination-32B's count); a folder's config.json decides.
_32B = dict(
    _COMMON,
    hidden_size=6144,
    intermediate_size=23040,
    num_hidden_layers=61,
    num_attention_heads=48,
    attention_bias=False,
)

RELEASED: dict[str, dict] = {
    "glm4_9b_0414": _9B,
    "glmz1_9b_0414": _9B,
    "glm4_32b_0414": _32B,
    "glmz1_32b_0414": _32B,
}


def released_config(name: str) -> Glm4Config:
    """Architecture of a released 0414 model by preset name, without any download."""
    if name not in RELEASED:
        raise KeyError(f"unknown GLM-4-0414 preset {name!r}; known: {', '.join(RELEASED)}")
    return Glm4Config(**RELEASED[name])
