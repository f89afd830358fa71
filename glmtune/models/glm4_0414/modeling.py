"""GLM-4-0414 / GLM-Z1-0414 causal LM with transformers' `Glm4ForCausalLM` module tree, on transformers 4.40.2.

    Glm4ForCausalLM
      model: Glm4Model
        embed_tokens                      [vocab, hidden]
        layers.N.input_layernorm
        layers.N.self_attn.{q_proj, k_proj, v_proj (bias per attention_bias), o_proj (no bias)}
        layers.N.post_self_attn_layernorm          (after attention, before its residual add)
        layers.N.post_attention_layernorm
        layers.N.mlp.{gate_up_proj (gate rows first), down_proj}
        layers.N.post_mlp_layernorm                (after the MLP, before its residual add)
        norm
        rotary_emb (inv_freq buffer, not saved)
      lm_head                             [vocab, hidden], untied

The names are the checkpoint's, so official sharded safetensors load as they are, adapters target HF names and
merged exports need no renaming. The maths is the reference's (transformers' modeling_glm4.py, read in
../shared/reference/glm-0414-engines-scaleout-2026-11.md §1.2): GLM's interleaved partial rotary embedding
(kernels/layers.py says why it is ChatGLM's), SDPA with 1/sqrt(head_dim), SwiGLU up * silu(gate), RMSNorm casting
to the input dtype before the weight, loss on fp32 logits. What attention, the MLP tiles, the block loop and the
loss head run is models/kernels', shared with the ChatGLM family: packing with per-document attention, Ulysses,
the tiled MLP, checkpoint offload, the chunked loss, the KV-cache buffer. tests/models/test_glm4_0414_reference.py holds it
against transformers' own class.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from ..kernels.attention import GroupedAttention, set_sequence_group
from ..kernels.causal_lm import CausalLMForward, generation_inputs
from ..kernels.layers import RMSNorm, RotaryEmbedding, TiledMLP, run_layers
from ..kernels.masks import positions_and_mask
from ..kernels.ulysses import SequenceGroup
from .configuration import Glm4Config


def _norm(config: Glm4Config) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, weight_last=True)


class Glm4Attention(GroupedAttention):
    def __init__(self, config: Glm4Config):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.groups * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.groups * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.dropout_p = config.attention_dropout

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim)
        return q, k, self.v_proj(x).view(b, s, self.groups, self.head_dim)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)


class Glm4MLP(TiledMLP):
    def __init__(self, config: Glm4Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def projections(self) -> tuple[nn.Module, nn.Module]:
        return self.gate_up_proj, self.down_proj


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: Glm4Config):
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = Glm4Attention(config)
        self.post_self_attn_layernorm = _norm(config)
        self.post_attention_layernorm = _norm(config)
        self.mlp = Glm4MLP(config)
        self.post_mlp_layernorm = _norm(config)

    def forward(self, hidden, mask, rope, kv_cache=None, use_cache=False):
        attn, new_cache = self.self_attn(self.input_layernorm(hidden), mask, rope, kv_cache, use_cache)
        hidden = hidden + self.post_self_attn_layernorm(attn)
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.post_mlp_layernorm(mlp), new_cache


class Glm4PreTrainedModel(PreTrainedModel):
    config_class = Glm4Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Glm4DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        # Only tiny random checkpoints and meta-device models are ever initialised here; real weights are loaded.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


class Glm4Model(Glm4PreTrainedModel):
    def __init__(self, config: Glm4Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm4DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _norm(config)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        # Set by PreTrainedModel.gradient_checkpointing_enable(); offload by the trainer (kernels.layers.run_layers).
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = checkpoint
        self.offload_checkpoints = False
        # Attention of packed rows (set by the trainer; ChatGLMModel.packed_attention says what each value does).
        self.packed_attention = "auto"
        self.sequence_group: SequenceGroup | None = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def set_sequence_group(self, sp: SequenceGroup | None) -> None:
        """Share each sequence over the ranks of `sp` (models/kernels/ulysses.py): forward then takes this rank's
        contiguous 1/N of every row and returns those tokens' hidden states. None: whole sequences again."""
        if sp is self.sequence_group:
            return
        set_sequence_group(self, sp, self.config.num_attention_heads, self.config.num_key_value_heads)
        self.sequence_group = sp

    # The decoder's inputs in the order the causal LM passes them (kernels/causal_lm.py), in rows (fmt: skip).
    def forward(
        self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
        use_cache=False, seq_ids=None,
    ) -> tuple[torch.Tensor, tuple | None]:  # fmt: skip
        """seq_ids [B, S]: packed rows (data/packing.py), which example each position belongs to (-1 = pad)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids, mask = positions_and_mask(
            self, inputs_embeds, position_ids, attention_mask, past_key_values, seq_ids
        )
        rope = self.rotary_emb(position_ids, inputs_embeds.dtype)
        hidden, presents = run_layers(self, self.layers, inputs_embeds, mask, rope, past_key_values, use_cache)
        return self.norm(hidden), presents


class Glm4ForCausalLM(CausalLMForward, Glm4PreTrainedModel):
    # The planner's and quantizer's handle on the decoder blocks (quantize.py: their Linears take NF4/int8).
    block_prefix = "model.layers."

    def __init__(self, config: Glm4Config):
        super().__init__(config)
        self.model = Glm4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by the trainer from the plan (kernels/causal_lm.py); not part of config.json.
        self.loss_chunk_tokens = 0
        self.loss_reduction = "mean"
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def set_sequence_group(self, sp: SequenceGroup | None) -> None:
        self.model.set_sequence_group(sp)

    @property
    def checkpointed(self) -> nn.Module:
        return self.model

    def decode(self, ids, positions, mask, past, embeds, seq_ids, labels, use_cache, **kwargs):
        """CausalLMForward's decoder step (keyword inputs of other models' generate() are accepted and ignored)."""
        hidden, presents = self.model(ids, positions, mask, past, embeds, use_cache, seq_ids=seq_ids)
        return hidden, presents, labels

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, position_ids=None, use_cache=True, **kwargs
    ):
        return generation_inputs(input_ids, past_key_values, attention_mask, position_ids, use_cache)


__all__ = ["Glm4ForCausalLM", "Glm4Model", "Glm4DecoderLayer", "Glm4PreTrainedModel"]
