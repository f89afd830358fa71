"""Grouped-query attention after the projections, as every GLM family runs it: the KV cache (a buffer allocated
once per generate() call, or concatenation), one-token decoding over the KV groups as stored, the GQA expansion,
the three mask paths (dense SDPA mask, per-document spans, FlexAttention block mask) and Ulysses' exchanges.

A family's attention module subclasses GroupedAttention and supplies `split_qkv` (its projections: q [b, s, heads,
d], k and v [b, s, groups, d], which `project` turns to heads first and rotates) and `output` (its output
projection). What attention sees
is then the same for every family, and so is what the plan counts for it. The whole path is one `forward`, one
frame for torch.compile: per-document attention breaks the compiled block's graph there (segment_attention is
kept out of it), and a break one call deeper would cut the block into 6 graphs instead of 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .docattention import DocumentSpans, segment_attention
from .layers import apply_rotary
from .ulysses import SequenceGroup, heads_for_attention, heads_to_sequence

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key, value), each [batch, kv_groups, seq, head_dim]


class GroupedAttention(nn.Module):
    """Set by the subclass: heads, groups (KV heads), head_dim, dropout_p; and split_qkv and output below."""

    heads: int
    groups: int
    head_dim: int
    dropout_p: float = 0.0
    # Set by the model's set_sequence_group: the ranks that share each sequence (None = this process alone).
    sequence_group: SequenceGroup | None = None
    # Set by glmtune.models.kvcache.preallocated_kv_cache: new tokens to reserve room for (0 = off).
    kv_reserve = 0
    _kv_buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> q [b, s, heads, d], k and v [b, s, groups, d]: the family's projections."""
        raise NotImplementedError

    def project(self, x: torch.Tensor, rope: torch.Tensor):
        """x [b, s, hidden] -> q [b, heads, s, d], k and v [b, groups, s, d], rotary applied."""
        q, k, v = (t.transpose(1, 2) for t in self.split_qkv(x))
        return apply_rotary(q, rope), apply_rotary(k, rope), v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [b, s, heads x d] -> [b, s, hidden]."""
        raise NotImplementedError

    def forward(self, x, mask, rope, kv_cache: KVCache | None, use_cache: bool):
        """x [b, s, hidden] -> (output [b, s, hidden], the layer's new cache or None)."""
        q, k, v = self.project(x, rope)
        b, s, hd = q.shape[0], q.shape[2], self.head_dim
        sp = self.sequence_group
        if sp is not None:  # this rank's heads over the whole sequence (models/kernels/ulysses.py)
            if kv_cache is not None or use_cache:
                raise ValueError("sequence-parallel attention is for training and scoring, not generation")
            q, k, v = heads_for_attention(q, k, v, sp)
        if self.kv_reserve and use_cache:  # inside preallocated_kv_cache(): write into one buffer per layer
            k, v = self._store(kv_cache, k, v)
        elif kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)
        new_cache = (k, v) if use_cache else None
        if s == 1 and kv_cache is not None and self.groups != self.heads and not self.training:
            return self.output(self._decode_grouped(q, k, v, mask).reshape(b, 1, self.heads * hd)), new_cache
        heads, groups, length = q.shape[1], k.shape[1], q.shape[2]  # this rank's, under sequence parallelism
        if groups != heads:  # query head i reads KV group i // (heads / groups), as the references
            rep = heads // groups
            k = k.unsqueeze(2).expand(b, groups, rep, k.shape[2], hd).reshape(b, heads, k.shape[2], hd)
            v = v.unsqueeze(2).expand(b, groups, rep, v.shape[2], hd).reshape(b, heads, v.shape[2], hd)
        if isinstance(mask, BlockMask):  # packed rows on CUDA (kernels/masks.document_block_mask): no dropout
            out = flex_attention(q, k, v, block_mask=mask)
        elif isinstance(mask, DocumentSpans):  # packed rows, one document at a time (kernels/docattention.py)
            out = segment_attention(q, k, v, mask, self.dropout_p if self.training else 0.0)
        else:
            causal = mask is None and length > 1 and kv_cache is None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout_p if self.training else 0.0
            )
        if sp is not None:
            out = heads_to_sequence(out, sp)
        return self.output(out.transpose(1, 2).reshape(b, s, self.heads * hd)), new_cache

    def _store(self, cache: KVCache | None, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """Append k, v to a buffer allocated once (prompt + kv_reserve tokens) and return views of the filled
        part, instead of concatenating (a fresh copy of the whole cache per layer and token). A cache that is
        not the front of this layer's buffer (or a full buffer) falls back to concatenation."""
        buffer = self._kv_buffer
        past = 0 if cache is None else cache[0].shape[2]
        mine = cache is None or (
            buffer is not None
            and cache[0].data_ptr() == buffer[0].data_ptr()
            and cache[0].shape[0] == buffer[0].shape[0]
        )
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
        rows = q.view(b, self.groups, self.heads // self.groups, hd)  # head i -> group i // rep, as above
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
        return out.reshape(b, self.heads, hd)


def set_sequence_group(model: nn.Module, sp: SequenceGroup | None, heads: int, kv_groups: int) -> None:
    """Point every GroupedAttention of `model` at `sp` (None: whole sequences again), after checking that the
    heads split over it."""
    if sp is not None:
        why = sp.check_heads(heads, kv_groups)
        if why:
            raise ValueError(f"sequence parallelism over {sp.size} ranks: {why}")
    for module in model.modules():
        if isinstance(module, GroupedAttention):
            module.sequence_group = sp
