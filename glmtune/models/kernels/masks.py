"""Attention masks of the GLM models: the padding/causal SDPA mask, and the dense or FlexAttention mask of packed
rows (data/packing.py) that keeps each example's attention inside the example (docattention.py is the
per-document path that needs neither)."""

from __future__ import annotations

import torch


def build_attention_mask(attention_mask: torch.Tensor | None, q_len: int, past_len: int) -> torch.Tensor | None:
    """Boolean SDPA mask [B, 1, q, past+q] (True = attend), or None for the plain causal case.

    None is returned when no pad can influence a real token: no padding, a single new token, or right
    padding without a cache (causality already hides later pads). Query rows that are pads attend to
    everything, so SDPA never sees an all-masked row (NaN); their outputs are never used.
    """
    total = past_len + q_len
    if attention_mask is None or bool(attention_mask.all()):
        if past_len == 0 or q_len == 1:
            return None
        keys = torch.ones(
            1, total, dtype=torch.bool, device=attention_mask.device if attention_mask is not None else None
        )
    else:
        keys = attention_mask.bool()
        right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
        if past_len == 0 and right_padded:
            return None
    causal = torch.ones(q_len, total, dtype=torch.bool, device=keys.device).tril(diagonal=past_len)
    mask = causal[None, None] & keys[:, None, None, -total:]
    return mask | ~keys[:, None, -q_len:, None]


def document_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal SDPA mask [B, 1, S, S] for packed rows (data/packing.py): a query attends to
    earlier keys of its own example only. Padding (seq id -1) attends to earlier padding, never to a real
    token and never seen by one; every query sees at least itself, so no row is all-masked (NaN)."""
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    causal = torch.ones(seq_ids.shape[1], seq_ids.shape[1], dtype=torch.bool, device=seq_ids.device).tril()
    return (same & causal)[:, None]


def document_block_mask(seq_ids: torch.Tensor):
    """The same mask as document_mask, as a FlexAttention BlockMask: blocks of 128 x 128 where no query
    shares an example with a key are skipped, so a row of k examples costs ~1/k of the dense attention.
    Only worth it where flex_attention is compiled (CUDA with train.compile); its backward needs CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_example_causal(b, h, q, kv):
        return (seq_ids[b, q] == seq_ids[b, kv]) & (q >= kv)

    s = seq_ids.shape[1]
    return create_block_mask(same_example_causal, seq_ids.shape[0], None, s, s, device=seq_ids.device)


def layer_mask(seq_ids, attention_mask, packed_attention: str, length: int, past_len: int, sp, device):
    """What every layer of one forward attends with: a packed row's per-document mask (dense, spans or
    FlexAttention, by `packed_attention` and the row length) or the padding/causal mask. Under a sequence
    group (`sp`) the inputs are this rank's shard and attention sees the whole row, so they are gathered first
    ([B, S] integers, cheap beside the activations). `length`: this rank's positions."""
    from .docattention import document_spans, packed_path
    from .ulysses import gather_sequence

    if sp is not None:
        seq_ids = gather_sequence(seq_ids.to(device), sp) if seq_ids is not None else None
        attention_mask = gather_sequence(attention_mask.to(device), sp) if attention_mask is not None else None
        length = length * sp.size
    if seq_ids is None:
        return build_attention_mask(attention_mask, length, past_len)
    if past_len:
        raise ValueError("seq_ids (packed rows) are for training and scoring, not generation with a cache")
    seq_ids = seq_ids.to(device)
    path = packed_path(packed_attention, length)  # auto: by the (gathered) row length
    return (
        document_block_mask(seq_ids)
        if path == "flex"
        else document_spans(seq_ids)
        if path == "segments"
        else document_mask(seq_ids)
    )


def default_positions(batch: int, length: int, past_len: int, sp, device) -> torch.Tensor:
    """Position ids when the caller gave none: counting on from the cache; under a sequence group this rank's
    tokens are the rank-th 1/N of the row."""
    start = past_len + (sp.rank * length if sp is not None else 0)
    return torch.arange(start, start + length, device=device).expand(batch, length)


def positions_and_mask(decoder, inputs_embeds, position_ids, attention_mask, past_key_values, seq_ids):
    """A decoder step's position ids (default_positions where the caller gave none) and the mask every layer gets
    (layer_mask), from the decoder's packed_attention and sequence_group and the cache's length."""
    b, s = inputs_embeds.shape[:2]
    past_len = past_key_values[0][0].shape[2] if past_key_values else 0
    sp, device = decoder.sequence_group, inputs_embeds.device
    if position_ids is None:
        position_ids = default_positions(b, s, past_len, sp, device)
    return position_ids, layer_mask(seq_ids, attention_mask, decoder.packed_attention, s, past_len, sp, device)
