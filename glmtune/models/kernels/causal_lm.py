"""The loss head and generation helpers every GLM causal LM shares: the reference loss on fp32 logits, the
lower-memory chunked loss, the labels' shift (done by the caller under sequence parallelism), and the position ids
of a decoding step.

`loss_chunk_tokens` (the plan's chunk, 0 = the reference loss) and `loss_reduction` ("mean" over this batch's
target tokens, the reference; or "sum", which the trainer divides by the whole optimizer step's target tokens so
that how a global batch is split never changes the gradient) are attributes the trainer sets on the model.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

from .layers import no_early_stop


def lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    head: torch.nn.Module,
    shift: bool,
    chunk_tokens: int,
    reduction: str,
    ckpt,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) of the LM head over `hidden`. With labels and a chunk size the logits are never built
    whole (returned None). shift=False: labels are already each position's target (a sequence-parallel shard:
    train/sequence.py shifted them on the whole row before cutting it). A sum stays fp32: a bf16 sum of a whole
    batch would round away the digits a mean keeps. `ckpt`: the decoder's checkpoint function (None = not set)."""
    if labels is not None and chunk_tokens > 0:
        loss = chunked_loss(hidden, labels, head, shift, chunk_tokens, reduction, ckpt)
        return (loss if reduction == "sum" else loss.to(hidden.dtype)), None
    logits = head(hidden)
    if labels is None:
        return None, logits
    # The reference: fp32 logits, shift inside the model, mean over labelled tokens.
    logits = logits.to(torch.float32)
    shifted = logits[..., :-1, :].contiguous() if shift else logits
    targets = labels[..., 1:] if shift else labels
    loss = F.cross_entropy(
        shifted.view(-1, shifted.size(-1)),
        targets.reshape(-1).to(shifted.device),
        ignore_index=-100,
        reduction=reduction,
    )
    return (loss if reduction == "sum" else loss.to(hidden.dtype)), logits.to(hidden.dtype)


def chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: torch.nn.Module,
    shift: bool,
    chunk_tokens: int,
    reduction: str,
    ckpt,
) -> torch.Tensor:
    """Same value as the reference loss, but fp32 logits exist for one chunk of tokens at a time: each chunk's
    logits are recomputed in backward instead of being kept (peak ~chunk x vocab x 4 B x 3)."""
    h = (hidden[:, :-1] if shift else hidden).reshape(-1, hidden.size(-1))
    y = (labels[:, 1:] if shift else labels).reshape(-1).to(h.device)
    if ckpt is None or ckpt is checkpoint:  # not configured by gradient_checkpointing_enable()
        ckpt = partial(checkpoint, use_reentrant=False)

    def chunk_sum(hs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(hs).to(torch.float32), ys, ignore_index=-100, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    with no_early_stop():  # layers.no_early_stop says why
        for start in range(0, h.size(0), chunk_tokens):
            hs, ys = h[start : start + chunk_tokens], y[start : start + chunk_tokens]
            if bool((ys != -100).any()):
                total = total + (ckpt(chunk_sum, hs, ys) if torch.is_grad_enabled() else chunk_sum(hs, ys))
    return total if reduction == "sum" else total / (y != -100).sum().clamp(min=1)


class CausalLMForward:
    """The forward both families' causal LMs share, mixed in before their PreTrainedModel: transformers' argument
    list (output_attentions, output_hidden_states and return_dict are accepted and ignored: the output is always a
    CausalLMOutputWithPast without them), the family's `decode` for the decoder's hidden states, then lm_output.

    A family defines `decode(ids, positions, mask, past, embeds, seq_ids, labels, use_cache, **extra)`, which
    returns (hidden, presents, labels) for the decoder's inputs (`extra`: what only that family takes, GLM-4V's
    images), and `checkpointed`: the module that holds the decoder's checkpoint function (set by
    gradient_checkpointing_enable)."""

    # Rows: the decoder's inputs; the loss's labels and transformers' flags; glmtune's own (packing, generate()'s
    # last logit) and a family's extra inputs. Kept in rows by hand (fmt: skip), as transformers' own order.
    def forward(
        self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
        labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
        return_last_logit=False, seq_ids=None, **extra,
    ) -> CausalLMOutputWithPast:  # fmt: skip
        # A cache is only useful for generation; in training it would just hold K/V of every layer.
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        hidden, presents, labels = self.decode(
            input_ids, position_ids, attention_mask, past_key_values, inputs_embeds, seq_ids, labels, use_cache, **extra
        )
        ckpt = self.checkpointed._gradient_checkpointing_func
        return lm_output(self, hidden, presents, labels, return_last_logit, ckpt)

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return reorder_cache(past_key_values, beam_idx)


def lm_output(lm, hidden: torch.Tensor, presents, labels, last_only: bool, ckpt) -> CausalLMOutputWithPast:
    """What a causal LM's forward returns for its decoder's hidden states: the loss against `labels` and the logits
    (of the last position only for a generate() step: `last_only`), through `lm`'s output embeddings with its
    loss_chunk_tokens and loss_reduction, and the KV cache. Under sequence parallelism each rank holds a shard of
    the row: the caller shifted the labels on the whole row before cutting it (train/sequence.py), so position t's
    label is already its target. `ckpt`: the decoder's checkpoint function."""
    if last_only:
        hidden = hidden[:, -1:]
    shift = lm.base_model.sequence_group is None
    loss, logits = lm_loss(
        hidden, labels, lm.get_output_embeddings(), shift, lm.loss_chunk_tokens, lm.loss_reduction, ckpt
    )
    return CausalLMOutputWithPast(
        loss=loss, logits=logits, past_key_values=tuple(presents) if presents is not None else None
    )


def generation_inputs(input_ids, past_key_values, attention_mask, position_ids, use_cache: bool) -> dict:
    """prepare_inputs_for_generation's answer for a text step: the prompt whole (no cache yet), then the newest
    token only; an all-ones mask when generate() gave none; positions from step_positions."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = step_positions(input_ids, attention_mask, position_ids, past_key_values is not None)
    if past_key_values is not None:
        input_ids = input_ids[:, -1:]
    return {
        "input_ids": input_ids,
        "past_key_values": past_key_values,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "use_cache": use_cache,
        "return_last_logit": True,
    }


def step_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, past: bool
) -> torch.Tensor:
    """Position ids of a generate() step. The prompt (no cache yet): left padding, real tokens count from 0, as
    the official tokenizer's position_ids do. A decoding step: caller position_ids (the official tokenizer returns
    them) cover the prompt only and generate() passes them unchanged each step, so the last one is advanced by the
    tokens generated since."""
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if past:
        position_ids = position_ids[:, -1:] + (input_ids.shape[1] - position_ids.shape[1])
    return position_ids


def reorder_cache(past_key_values, beam_idx):
    """The tuple KV cache reordered for beam search."""
    return tuple(
        (k.index_select(0, beam_idx.to(k.device)), v.index_select(0, beam_idx.to(v.device))) for k, v in past_key_values
    )
