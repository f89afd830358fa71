"""Building blocks of the GLM-4 / ChatGLM3 decoder (the model class is in modeling_glm4.py).

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

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration import GLMConfig
from ..kernels.docattention import DocumentSpans, segment_attention
from ..kernels.tiling import tiled
from ..kernels.ulysses import SequenceGroup, heads_for_attention, heads_to_sequence

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key, value), each [batch, kv_groups, seq, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in fp32 even for bf16 inputs; the product promotes to fp32 and is cast back, as the reference.
        # (float64 inputs, used by the tests, keep float64.)
        variance = x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
        return (self.weight * (x * torch.rsqrt(variance + self.eps))).to(x.dtype)


def make_norm(config: GLMConfig) -> nn.Module:
    if config.rmsnorm:
        return RMSNorm(config.hidden_size, config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class RotaryEmbedding(nn.Module):
    """cos/sin table for the rotated half of each head (64 of 128 dims in the released models)."""

    def __init__(self, config: GLMConfig):
        super().__init__()
        self.dim = config.kv_channels // 2
        self.base = 10000.0 * config.rope_ratio
        # Kept for checkpoint compatibility only (merged checkpoints carry it, as the official ones do). It is
        # created on whatever device the model is built on (a `torch.device` context, meta, DeepSpeed's
        # zero.Init) and never read in forward: the frequencies are recomputed in fp32 on the positions'
        # device, so a bf16 cast cannot degrade them and a buffer left on another device cannot break a step
        # (it stayed on the CPU under ZeRO-3 on a GPU: "Expected all tensors to be on the same device").
        self.register_buffer("inv_freq", self._theta(None), persistent=False)

    def _theta(self, device: torch.device | None) -> torch.Tensor:
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return 1.0 / (self.base ** exponent)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """position_ids [B, S] -> [B, S, dim/2, 2] with (cos, sin) in the last axis."""
        angles = position_ids[..., None].to(torch.float32) * self._theta(position_ids.device)
        cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        return cache.to(dtype) if dtype in (torch.float16, torch.bfloat16) else cache


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the first 2*rope.shape[-2] dims; pass the rest through."""
    b, h, s, _ = x.shape
    rot = rope.shape[-2] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    pairs = x_rot.reshape(b, h, s, rot // 2, 2)
    rope = rope.view(rope.shape[0], 1, s, rot // 2, 2)
    out = torch.stack(
        [pairs[..., 0] * rope[..., 0] - pairs[..., 1] * rope[..., 1],
         pairs[..., 1] * rope[..., 0] + pairs[..., 0] * rope[..., 1]],
        dim=-1,
    ).flatten(3)
    return torch.cat([out, x_pass], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.kv_groups, config.kv_channels
        self.query_key_value = nn.Linear(config.hidden_size, config.qkv_out,
                                         bias=config.add_bias_linear or config.add_qkv_bias)
        self.dense = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        self.dropout_p = config.attention_dropout
        # multi_query_attention=false (full multi-head attention) has another official row layout: per head
        # [q_h | k_h | v_h], not all queries, then all keys, then all values. The weights stay in the
        # official order (so loading, ZeRO-3 shards, adapters and merged exports need no permutation) and
        # the projection's output is read in that order instead. The flag, not heads == groups, decides:
        # GQA with as many groups as heads keeps the blocked layout.
        self.per_head_qkv = not config.multi_query_attention

    def forward(self, x, mask, rope, kv_cache: KVCache | None, use_cache: bool):
        b, s, _ = x.shape
        hd = self.head_dim
        qkv = self.query_key_value(x)
        if self.per_head_qkv:
            q, k, v = qkv.view(b, s, self.heads, 3 * hd).split(hd, dim=-1)
        else:
            q, k, v = qkv.split([self.heads * hd, self.groups * hd, self.groups * hd], dim=-1)
            q, k, v = q.view(b, s, self.heads, hd), k.view(b, s, self.groups, hd), v.view(b, s, self.groups, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        sp = self.sequence_group
        if sp is not None:  # this rank's heads over the whole sequence (models/ulysses.py)
            if kv_cache is not None or use_cache:
                raise ValueError("sequence-parallel attention is for training and scoring, not generation")
            q, k, v = heads_for_attention(q, k, v, sp)
        if self.kv_reserve and use_cache:  # inside preallocated_kv_cache(): write into one buffer per layer
            k, v = self._store(kv_cache, k, v)
        elif kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
        new_cache = (k, v) if use_cache else None
        if s == 1 and kv_cache is not None and self.groups != self.heads and not self.training:
            return self.dense(self._decode_grouped(q, k, v, mask).reshape(b, 1, self.heads * hd)), new_cache
        heads, groups, length = q.shape[1], k.shape[1], q.shape[2]  # this rank's, under sequence parallelism
        if groups != heads:  # query head i reads KV group i // (heads / groups), as the reference
            rep = heads // groups
            k = k.unsqueeze(2).expand(b, groups, rep, k.shape[2], hd).reshape(b, heads, k.shape[2], hd)
            v = v.unsqueeze(2).expand(b, groups, rep, v.shape[2], hd).reshape(b, heads, v.shape[2], hd)
        if isinstance(mask, BlockMask):  # packed rows on CUDA (modeling_glm4.document_block_mask): no dropout
            out = flex_attention(q, k, v, block_mask=mask)
        elif isinstance(mask, DocumentSpans):  # packed rows, one document at a time (models/docattention.py)
            out = segment_attention(q, k, v, mask, self.dropout_p if self.training else 0.0)
        else:
            causal = mask is None and length > 1 and kv_cache is None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 dropout_p=self.dropout_p if self.training else 0.0)
        if sp is not None:
            out = heads_to_sequence(out, sp)
        return self.dense(out.transpose(1, 2).reshape(b, s, self.heads * hd)), new_cache

    # Set by ChatGLMModel.set_sequence_group: the ranks that share each sequence (None = this process alone).
    sequence_group: SequenceGroup | None = None
    # Set by glmtune.models.kvcache.preallocated_kv_cache: new tokens to reserve room for (0 = off).
    kv_reserve = 0
    _kv_buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    def _store(self, cache: KVCache | None, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """Append k, v to a buffer allocated once (prompt + kv_reserve tokens) and return views of the filled
        part, instead of concatenating (a fresh copy of the whole cache per layer and token). A cache that is
        not the front of this layer's buffer (or a full buffer) falls back to concatenation."""
        buffer = self._kv_buffer
        past = 0 if cache is None else cache[0].shape[2]
        mine = (cache is None or (buffer is not None and cache[0].data_ptr() == buffer[0].data_ptr()
                                  and cache[0].shape[0] == buffer[0].shape[0]))
        if cache is None:
            shape = (k.shape[0], k.shape[1], k.shape[2] + self.kv_reserve, k.shape[3])
            buffer = self._kv_buffer = (k.new_empty(shape), v.new_empty(shape))
        elif not mine or past + k.shape[2] > buffer[0].shape[2]:
            return torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        end = past + k.shape[2]
        buffer[0][:, :, past:end] = k
        buffer[1][:, :, past:end] = v
        return buffer[0][:, :, :end], buffer[1][:, :, :end]

    def _decode_grouped(self, q, k, v, mask):
        """One new token: the query heads that share a KV group become that group's rows, so attention reads the
        cache as stored ([b, groups, past, d]) instead of a copy expanded to every head (16x the cache per
        layer and step for GLM-4's 32 heads over 2 groups). A [b, 1, 1, past] mask broadcasts over the rows."""
        b, _, _, hd = q.shape
        rows = q.view(b, self.groups, self.heads // self.groups, hd)  # head i -> group i // rep, as below
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
        return out.reshape(b, self.heads, hd)


class MLP(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=config.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    # Set by models.tiling.set_mlp_tile_tokens from the plan: above this many tokens (batch x sequence) the MLP
    # runs in tiles of it, one tile's [tile, 2 x ffn] intermediate live at a time (0 = never tiled); under ZeRO-3
    # the tiles' checkpoints are reentrant (models/tiling.py says why).
    mlp_tile_tokens, mlp_tile_zero3 = 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < self.mlp_tile_tokens < x.numel() // x.shape[-1]:
            zero3 = ([p for p in self.parameters() if p.requires_grad and hasattr(p, "ds_id")]
                     if self.mlp_tile_zero3 else None)
            return tiled(self._swiglu, x, self.mlp_tile_tokens, zero3)
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(gate) * up)


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


def no_early_stop():
    """Non-reentrant checkpoints recompute their whole function in backward. By default they stop as soon as
    the last saved tensor is rebuilt, by raising an exception from the saved-tensor hook, i.e. from inside a
    C++ op; on CUDA with the allocator's history recording on (the run's OOM snapshot, probe/diagnose.py) that
    exception was lost while the op's temporaries were freed, and backward died with `SystemError: <built-in
    function cross_entropy_loss> returned NULL without setting an exception` (issue 33, bench/ckpt_early_stop.py).
    Without early stop nothing is raised; the price is the ops after the last saved tensor (none in a loss
    chunk, the block's last projection in a GLM block). Read when the forward runs; reentrant ones ignore it."""
    return set_checkpoint_early_stop(False)


class GLMTransformer(nn.Module):
    def __init__(self, config: GLMConfig):
        super().__init__()
        self.layers = nn.ModuleList(GLMBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = make_norm(config) if config.post_layer_norm else None
        # Set by PreTrainedModel.gradient_checkpointing_enable() through _set_gradient_checkpointing.
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = checkpoint
        # Set by the trainer from the plan: the inputs that reentrant checkpointing keeps for every block
        # (tokens x hidden x 2 B each: 2.5 GiB for 40 blocks at 8K) wait in pinned CPU memory until backward.
        self.offload_checkpoints = False

    def forward(self, hidden, mask, rope, kv_caches, use_cache):
        presents = [] if use_cache else None
        ckpt = self.gradient_checkpointing and self.training
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=hidden.is_cuda)
                   if ckpt and self.offload_checkpoints and torch.is_grad_enabled() else contextlib.nullcontext())
        with offload, no_early_stop():
            for i, layer in enumerate(self.layers):
                cache = kv_caches[i] if kv_caches is not None else None
                if ckpt:
                    hidden, present = self._gradient_checkpointing_func(layer.__call__, hidden, mask, rope, cache,
                                                                        use_cache)
                else:
                    hidden, present = layer(hidden, mask, rope, cache, use_cache)
                if use_cache:
                    presents.append(present)
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
