"""Building blocks of the GLM-4 / ChatGLM3 decoder under their official names (the model class is in modeling.py;
norm, rotary, attention core, tiled MLP and the block loop are models/kernels', shared with the other families).

Behaviour follows the reference `modeling_chatglm.py` (facts: ../shared/reference/glm4-facts.md §2-§5):
RMSNorm with an fp32 variance; rotary embedding on the first half of each head's dims with interleaved
adjacent pairs, base 10000 * rope_ratio; grouped-query attention (multi_query_group_num KV heads) through
a fused query_key_value projection with bias (its rows per head, [q|k|v], under full multi-head attention,
multi_query_attention=false, as the official files store them); SwiGLU MLP with a fused dense_h_to_4h;
pre-norm residuals; final norm; untied output layer; loss on fp32 logits.

Differences from the reference that change no result:
- batch-first tensors everywhere (ChatGLM3's reference is sequence-first; the maths is the same);
- the rotary table is built for the positions in use, not for all `seq_length` (131072) positions;
- right-padded batches without a KV cache run SDPA with `is_causal=True` and no dense mask: a real token
  can never see a later pad under a causal mask, so the result is identical and SDPA may use its
  memory-efficient kernels (the reference builds a dense [B, 1, L, L] mask for any padded batch);
- `gradient_checkpointing_enable()` really engages (the June-2024 reference silently ignores it, §5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import layers as kernels
from ..kernels.attention import GroupedAttention, KVCache  # noqa: F401 (KVCache re-exported)
from ..kernels.layers import RMSNorm, TiledMLP, apply_rotary, no_early_stop, run_layers  # noqa: F401 (re-exported)
from .configuration import GLMConfig


def make_norm(config: GLMConfig) -> nn.Module:
    if config.rmsnorm:
        return RMSNorm(config.hidden_size, config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class RotaryEmbedding(kernels.RotaryEmbedding):
    """GLM's rotary table at `transformer.rotary_pos_emb`: the first half of each head's dims, base
    10000 * rope_ratio."""

    def __init__(self, config: GLMConfig):
        super().__init__(config.kv_channels // 2, 10000.0 * config.rope_ratio)


class SelfAttention(GroupedAttention):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.kv_groups, config.kv_channels
        self.query_key_value = nn.Linear(
            config.hidden_size, config.qkv_out, bias=config.add_bias_linear or config.add_qkv_bias
        )
        self.dense = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        self.dropout_p = config.attention_dropout
        # multi_query_attention=false (full multi-head attention) has another official row layout: per head
        # [q_h | k_h | v_h], not all queries, then all keys, then all values. The weights stay in the
        # official order (so loading, ZeRO-3 shards, adapters and merged exports need no permutation) and
        # the projection's output is read in that order instead. The flag, not heads == groups, decides:
        # GQA with as many groups as heads keeps the blocked layout.
        self.per_head_qkv = not config.multi_query_attention

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        hd = self.head_dim
        qkv = self.query_key_value(x)
        if self.per_head_qkv:
            return qkv.view(b, s, self.heads, 3 * hd).split(hd, dim=-1)
        q, k, v = qkv.split([self.heads * hd, self.groups * hd, self.groups * hd], dim=-1)
        return q.view(b, s, self.heads, hd), k.view(b, s, self.groups, hd), v.view(b, s, self.groups, hd)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.dense(out)


class MLP(TiledMLP):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=config.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    def projections(self) -> tuple[nn.Module, nn.Module]:
        return self.dense_h_to_4h, self.dense_4h_to_h


class GLMBlock(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.post_ln_residual = config.apply_residual_connection_post_layernorm
        self.input_layernorm = make_norm(config)
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = MLP(config)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, hidden, mask, rope, kv_cache=None, use_cache=False):
        normed = self.input_layernorm(hidden)
        attn, new_cache = self.self_attention(normed, mask, rope, kv_cache, use_cache)
        residual = normed if self.post_ln_residual else hidden
        hidden = F.dropout(attn, self.hidden_dropout, self.training) + residual
        normed = self.post_attention_layernorm(hidden)
        residual = normed if self.post_ln_residual else hidden
        return F.dropout(self.mlp(normed), self.hidden_dropout, self.training) + residual, new_cache


class GLMTransformer(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.layers = nn.ModuleList(GLMBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = make_norm(config) if config.post_layer_norm else None
        # Set by PreTrainedModel.gradient_checkpointing_enable() through _set_gradient_checkpointing.
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = checkpoint
        # Set by the trainer from the plan (kernels/layers.run_layers says what it does).
        self.offload_checkpoints = False

    def forward(self, hidden, mask, rope, kv_caches, use_cache):
        hidden, presents = run_layers(self, self.layers, hidden, mask, rope, kv_caches, use_cache)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden, presents


class Embedding(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.fp32_residual_connection = config.fp32_residual_connection

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.word_embeddings(input_ids)
        return emb.float() if self.fp32_residual_connection else emb
