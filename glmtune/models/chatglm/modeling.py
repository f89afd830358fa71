"""GLM-4 / ChatGLM3 causal LM with the official module tree, as a transformers PreTrainedModel.

    ChatGLMForConditionalGeneration
      transformer: ChatGLMModel
        embedding.word_embeddings        [padded_vocab, hidden]
        rotary_pos_emb (inv_freq buffer, not saved; accepted and ignored when a checkpoint has it)
        encoder.layers.N.{input_layernorm, self_attention.{query_key_value, dense},
                          post_attention_layernorm, mlp.{dense_h_to_4h, dense_4h_to_h}}
        encoder.final_layernorm
        output_layer                     [padded_vocab, hidden], untied
        vision                           GLM-4V only (config.vision_config): EVA2-CLIP + GLU, see vision.py

Works with HF `generate()` (legacy tuple KV cache holding the un-expanded KV groups: 2 heads, not 32),
`gradient_checkpointing_enable()` (reentrant or not, via gradient_checkpointing_kwargs), PEFT and the Trainer.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration import GLMConfig
from ..kernels.docattention import document_spans, packed_path
from ..kernels.masks import build_attention_mask, document_block_mask, document_mask  # noqa: F401 (re-exported)
from .layers import Embedding, GLMBlock, GLMTransformer, RMSNorm, RotaryEmbedding, SelfAttention, no_early_stop
from ..kernels.ulysses import PAD_FILL, SequenceGroup, gather_sequence, pad_and_shard, shift_labels
from .vision import EVA2CLIPModel, splice_images


class GLMPreTrainedModel(PreTrainedModel):
    config_class = GLMConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    # The vision tower is listed too: split over GPUs it breaks (GLM-4 issues #200, #350).
    _no_split_modules = ["GLMBlock", "EVA2CLIPModel"]
    _keys_to_ignore_on_load_unexpected = [r"rotary_pos_emb\.inv_freq"]

    def _init_weights(self, module: nn.Module) -> None:
        # Only tiny random checkpoints and meta-device models are ever initialised here; real weights are loaded.
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight.data.fill_(1.0)


class ChatGLMModel(GLMPreTrainedModel):
    def __init__(self, config: GLMConfig):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.vision = EVA2CLIPModel(config) if config.vision_config else None
        # Attention of packed rows: "sdpa" (dense boolean mask, any device), "segments" (per-document SDPA, no
        # [S, S] tensor), "flex" (FlexAttention block mask; needs attention dropout 0) or "auto" (sdpa up to
        # docattention.DENSE_MASK_MAX positions a row, segments above). Set by the trainer (train/compile.py);
        # not part of config.json.
        self.packed_attention = "auto"
        self.sequence_group: SequenceGroup | None = None
        self.post_init()

    def set_sequence_group(self, sp: SequenceGroup | None) -> None:
        """Share each sequence over the ranks of `sp` (models/ulysses.py): from then on forward takes this rank's
        contiguous 1/N of every row (ids, position ids, seq ids, mask), and returns the hidden states of those
        tokens; rows with images come whole and are cut after the merge (merge_images). None: this process holds
        whole sequences again."""
        if sp is self.sequence_group:  # set before every training micro-step: nothing to walk through again
            return
        if sp is not None:
            why = sp.check_heads(self.config.num_attention_heads, self.config.kv_groups)
            if why:
                raise ValueError(f"sequence parallelism over {sp.size} ranks: {why}")
        self.sequence_group = sp
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.sequence_group = sp

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def merge_images(self, input_ids, inputs_embeds, position_ids, attention_mask, labels, images, image_rows,
                     seq_ids=None):
        """Run the vision tower on `images` (one per entry of `image_rows`; one per row when None) and splice
        its output into the embeddings. Returns (inputs_embeds, position_ids, attention_mask, labels, seq_ids).

        Under a sequence group every rank got the whole rows (train/sequence.py leaves image batches whole): each
        runs the frozen tower and the merge on them, then keeps its 1/N of the merged rows, labels shifted first
        (as shard_batch does for text). The merged position ids travel with the tokens: the patches keep their
        one shared position, which counting from the shard's offset would lose."""
        if inputs_embeds is None:
            inputs_embeds = self.embedding(input_ids)
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=inputs_embeds.device).expand(b, s)
        if image_rows is None:
            image_rows = torch.arange(b)
        tower_dtype = self.vision.conv.weight.dtype
        features = self.vision(images.to(self.vision.conv.weight.device, tower_dtype))
        # A batch whose every row ends on a real token is left-padded (generation): pad text rows on the left.
        pad_left = attention_mask is None or bool(attention_mask[:, -1].all())
        merged = splice_images(inputs_embeds, input_ids, position_ids, attention_mask, labels, features, image_rows,
                               self.config.boi_token_id, self.config.eoi_token_id, pad_left, seq_ids)
        sp = self.sequence_group
        if sp is None:
            return merged
        embeds, position_ids, attention_mask, labels, seq_ids = merged
        labels = shift_labels(labels) if labels is not None else None
        return tuple(pad_and_shard(x, PAD_FILL[key], sp) if x is not None else None for x, key in
                     ((embeds, "inputs_embeds"), (position_ids, "position_ids"), (attention_mask, "attention_mask"),
                      (labels, "labels"), (seq_ids, "seq_ids")))

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, use_cache=False, images=None, image_rows=None, seq_ids=None):
        """seq_ids [B, S]: packed rows (data/packing.py), which example each position belongs to (-1 = pad);
        attention then stays inside each example and attention_mask is not needed."""
        sp = self.sequence_group
        if images is not None and self.vision is not None and not past_key_values and len(images):
            inputs_embeds, position_ids, attention_mask, _, seq_ids = self.merge_images(
                input_ids, inputs_embeds, position_ids, attention_mask, None, images, image_rows, seq_ids)
        if inputs_embeds is None:
            inputs_embeds = self.embedding(input_ids)
        b, s = inputs_embeds.shape[:2]
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None:  # under sequence parallelism this rank's tokens are the rank-th 1/N of the row
            start = past_len + (sp.rank * s if sp is not None else 0)
            position_ids = torch.arange(start, start + s, device=inputs_embeds.device).expand(b, s)
        rope = self.rotary_pos_emb(position_ids, inputs_embeds.dtype)
        if sp is not None:  # masks are for attention, which sees the whole row: built from the gathered inputs
            seq_ids = gather_sequence(seq_ids.to(inputs_embeds.device), sp) if seq_ids is not None else None
            attention_mask = (gather_sequence(attention_mask.to(inputs_embeds.device), sp)
                              if attention_mask is not None else None)
            s = s * sp.size
        if seq_ids is not None:
            if past_len:
                raise ValueError("seq_ids (packed rows) are for training and scoring, not generation with a cache")
            seq_ids = seq_ids.to(inputs_embeds.device)
            path = packed_path(self.packed_attention, s)  # auto: by the (gathered) row length
            mask = (document_block_mask(seq_ids) if path == "flex" else
                    document_spans(seq_ids) if path == "segments" else document_mask(seq_ids))
        else:
            mask = build_attention_mask(attention_mask, s, past_len)
        return self.encoder(inputs_embeds, mask, rope, past_key_values, use_cache)


class ChatGLMForConditionalGeneration(GLMPreTrainedModel):
    def __init__(self, config: GLMConfig):
        super().__init__(config)
        self.transformer = ChatGLMModel(config)
        # Tokens per chunk of the lower-memory loss; 0 = the reference loss (full fp32 logits, ~1.8 MB/token
        # for the 151,552-token vocabulary). Set by the trainer from the plan; not part of config.json.
        self.loss_chunk_tokens = 0
        # "mean" (the reference: over this batch's target tokens) or "sum" (the trainer divides by the whole
        # optimizer step's target tokens, so how a global batch is split never changes the gradient). A sum
        # stays fp32: a bf16 sum of a whole batch would round away the digits a mean keeps.
        self.loss_reduction = "mean"
        self._image_layout = None  # generation with images: (prompt length, image rows, prompt ids)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.transformer.embedding.word_embeddings = value

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def set_output_embeddings(self, value):
        self.transformer.output_layer = value

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, return_last_logit=False, images=None, image_rows=None,
                seq_ids=None):
        # A cache is only useful for generation; in training it would just hold K/V of every layer.
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if images is not None and self.transformer.vision is not None and not past_key_values and len(images):
            # GLM-4V: 3 placeholder ids become boi + N patches + eoi; labels grow with -100 over the patches.
            inputs_embeds, position_ids, attention_mask, labels, seq_ids = self.transformer.merge_images(
                input_ids, inputs_embeds, position_ids, attention_mask, labels, images, image_rows, seq_ids)
            images = None
        hidden, presents = self.transformer(input_ids, position_ids, attention_mask, past_key_values,
                                            inputs_embeds, use_cache, seq_ids=seq_ids)
        if return_last_logit:
            hidden = hidden[:, -1:]
        loss = logits = None
        # Under sequence parallelism each rank holds a shard of the row: the caller shifted the labels on the whole
        # row before cutting it (train/sequence.py; merge_images for rows with images), so position t's label is
        # already its target.
        shift = self.transformer.sequence_group is None
        if labels is not None and self.loss_chunk_tokens > 0:
            loss = self._chunked_loss(hidden, labels, shift)
            loss = loss if self.loss_reduction == "sum" else loss.to(hidden.dtype)
        else:
            logits = self.transformer.output_layer(hidden)
            if labels is not None:
                # The reference: fp32 logits, shift inside the model, mean over labelled tokens.
                logits = logits.to(torch.float32)
                shifted = logits[..., :-1, :].contiguous() if shift else logits
                targets = labels[..., 1:] if shift else labels
                loss = F.cross_entropy(shifted.view(-1, shifted.size(-1)), targets.reshape(-1).to(shifted.device),
                                       ignore_index=-100, reduction=self.loss_reduction)
                logits = logits.to(hidden.dtype)
                loss = loss if self.loss_reduction == "sum" else loss.to(hidden.dtype)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=tuple(presents) if presents is not None else None)

    def _chunked_loss(self, hidden: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
        """Same value as the reference loss, but fp32 logits exist for one chunk of tokens at a time:
        each chunk's logits are recomputed in backward instead of being kept (peak ~chunk x vocab x 4 B x 3).
        shift=False: labels are already each position's target (a sequence-parallel shard)."""
        h = (hidden[:, :-1] if shift else hidden).reshape(-1, hidden.size(-1))
        y = (labels[:, 1:] if shift else labels).reshape(-1).to(h.device)
        head = self.transformer.output_layer
        ckpt = self.transformer.encoder._gradient_checkpointing_func
        if ckpt is checkpoint:  # not configured by gradient_checkpointing_enable()
            ckpt = partial(checkpoint, use_reentrant=False)

        def chunk_sum(hs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(head(hs).to(torch.float32), ys, ignore_index=-100, reduction="sum")

        total = hidden.new_zeros((), dtype=torch.float32)
        with no_early_stop():  # layers.no_early_stop says why
            for start in range(0, h.size(0), self.loss_chunk_tokens):
                hs, ys = h[start:start + self.loss_chunk_tokens], y[start:start + self.loss_chunk_tokens]
                if bool((ys != -100).any()):
                    total = total + (ckpt(chunk_sum, hs, ys) if torch.is_grad_enabled() else chunk_sum(hs, ys))
        return total if self.loss_reduction == "sum" else total / (y != -100).sum().clamp(min=1)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      position_ids=None, use_cache=True, images=None, image_rows=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            # Left padding: real tokens count from 0, as the official tokenizer's position_ids do. Image
            # patches share one position, so text positions never count them.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        inputs = {"use_cache": use_cache, "return_last_logit": True}
        if past_key_values is None:
            self._image_layout = None
            if images is not None and len(images):
                rows = image_rows if image_rows is not None else torch.arange(input_ids.shape[0])
                self._image_layout = (input_ids.shape[1], rows.tolist(), input_ids)
                inputs.update(images=images, image_rows=image_rows)
        else:
            # Caller position_ids (the official tokenizer returns them) cover the prompt only and generate()
            # passes them unchanged each step: advance the last one by the tokens generated since.
            position_ids = position_ids[:, -1:] + (input_ids.shape[1] - position_ids.shape[1])
            input_ids = input_ids[:, -1:]
            if self._image_layout is not None:  # the cache holds the spliced prompt: widen the mask to match
                attention_mask = self._spliced_mask(attention_mask, past_key_values[0][0].shape[2] + 1)
        return {**inputs, "input_ids": input_ids, "past_key_values": past_key_values,
                "position_ids": position_ids, "attention_mask": attention_mask}

    def _spliced_mask(self, mask: torch.Tensor, width: int) -> torch.Tensor:
        """The text mask laid out as vision.splice_images laid out the left-padded prompt: N-1 more ones
        after boi in image rows, N-1 zeros in front of the other rows; generated tokens follow."""
        _, rows, prompt_ids = self._image_layout
        grow = width - mask.shape[1]
        boi = self.config.boi_token_id
        out = []
        for r in range(mask.shape[0]):
            m = mask[r]
            if r in rows:
                at = int((prompt_ids[r] == boi).nonzero()[0]) + 1
                out.append(torch.cat([m[:at], m.new_ones(grow), m[at:]]))
            else:
                out.append(torch.cat([m.new_zeros(grow), m]))
        return torch.stack(out)

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return tuple((k.index_select(0, beam_idx.to(k.device)), v.index_select(0, beam_idx.to(v.device)))
                     for k, v in past_key_values)


__all__ = ["ChatGLMForConditionalGeneration", "ChatGLMModel", "GLMBlock", "GLMPreTrainedModel"]
