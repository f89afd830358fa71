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

import torch
from torch import nn
from transformers import PreTrainedModel

from ..kernels.attention import set_sequence_group
from ..kernels.causal_lm import CausalLMForward, generation_inputs
from ..kernels.masks import build_attention_mask, default_positions, layer_mask, positions_and_mask  # noqa: F401 (re-exported)
from ..kernels.ulysses import PAD_FILL, SequenceGroup, pad_and_shard, shift_labels
from .configuration import GLMConfig
from .layers import Embedding, GLMBlock, GLMTransformer, RMSNorm, RotaryEmbedding
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
        """Share each sequence over the ranks of `sp` (models/kernels/ulysses.py): from then on forward takes this
        rank's contiguous 1/N of every row (ids, position ids, seq ids, mask), and returns the hidden states of those
        tokens; rows with images come whole and are cut after the merge (merge_images). None: this process holds
        whole sequences again."""
        if sp is self.sequence_group:  # set before every training micro-step: nothing to walk through again
            return
        set_sequence_group(self, sp, self.config.num_attention_heads, self.config.kv_groups)
        self.sequence_group = sp

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def merge_images(
        self, input_ids, inputs_embeds, position_ids, attention_mask, labels, images, image_rows, seq_ids=None
    ):
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
        merged = splice_images(
            inputs_embeds,
            input_ids,
            position_ids,
            attention_mask,
            labels,
            features,
            image_rows,
            self.config.boi_token_id,
            self.config.eoi_token_id,
            pad_left,
            seq_ids,
        )
        sp = self.sequence_group
        if sp is None:
            return merged
        embeds, position_ids, attention_mask, labels, seq_ids = merged
        labels = shift_labels(labels) if labels is not None else None
        return tuple(
            pad_and_shard(x, PAD_FILL[key], sp) if x is not None else None
            for x, key in (
                (embeds, "inputs_embeds"),
                (position_ids, "position_ids"),
                (attention_mask, "attention_mask"),
                (labels, "labels"),
                (seq_ids, "seq_ids"),
            )
        )

    # The decoder's inputs in the order the causal LM passes them (kernels/causal_lm.py), in rows (fmt: skip).
    def forward(
        self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
        use_cache=False, images=None, image_rows=None, seq_ids=None,
    ) -> tuple[torch.Tensor, tuple | None]:  # fmt: skip
        """seq_ids [B, S]: packed rows (data/packing.py), which example each position belongs to (-1 = pad);
        attention then stays inside each example and attention_mask is not needed."""
        if images is not None and self.vision is not None and not past_key_values and len(images):
            inputs_embeds, position_ids, attention_mask, _, seq_ids = self.merge_images(
                input_ids, inputs_embeds, position_ids, attention_mask, None, images, image_rows, seq_ids
            )
        if inputs_embeds is None:
            inputs_embeds = self.embedding(input_ids)
        position_ids, mask = positions_and_mask(
            self, inputs_embeds, position_ids, attention_mask, past_key_values, seq_ids
        )
        rope = self.rotary_pos_emb(position_ids, inputs_embeds.dtype)
        return self.encoder(inputs_embeds, mask, rope, past_key_values, use_cache)


class ChatGLMForConditionalGeneration(CausalLMForward, GLMPreTrainedModel):
    # The decoder blocks (quantize.py: their Linears take NF4/int8 weights; the vision tower's do not).
    block_prefix = "transformer.encoder."

    def __init__(self, config: GLMConfig):
        super().__init__(config)
        self.transformer = ChatGLMModel(config)
        # Tokens per chunk of the lower-memory loss; 0 = the reference loss (full fp32 logits, ~1.8 MB/token
        # for the 151,552-token vocabulary). Set by the trainer from the plan; not part of config.json.
        self.loss_chunk_tokens = 0
        self.loss_reduction = "mean"  # or "sum" (kernels/causal_lm.py says why)
        self._image_layout = None  # generation with images: (prompt length, image rows, prompt ids)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.transformer.embedding.word_embeddings = value

    def set_sequence_group(self, sp: SequenceGroup | None) -> None:
        """ChatGLMModel.set_sequence_group: the caller need not know where the decoder sits."""
        self.transformer.set_sequence_group(sp)

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def set_output_embeddings(self, value):
        self.transformer.output_layer = value

    @property
    def checkpointed(self) -> nn.Module:
        return self.transformer.encoder

    def decode(self, ids, positions, mask, past, embeds, seq_ids, labels, use_cache, images=None, image_rows=None):
        """CausalLMForward's decoder step: GLM-4V's images are merged here, where the labels are at hand."""
        if images is not None and self.transformer.vision is not None and not past and len(images):
            # GLM-4V: 3 placeholder ids become boi + N patches + eoi; labels grow with -100 over the patches.
            embeds, positions, mask, labels, seq_ids = self.transformer.merge_images(
                ids, embeds, positions, mask, labels, images, image_rows, seq_ids
            )
        hidden, presents = self.transformer(ids, positions, mask, past, embeds, use_cache, seq_ids=seq_ids)
        return hidden, presents, labels

    def prepare_inputs_for_generation(
        self,
        input_ids,
        past_key_values=None,
        attention_mask=None,
        position_ids=None,
        use_cache=True,
        images=None,
        image_rows=None,
        **kwargs,
    ):
        # Image patches share one position, so text positions never count them.
        inputs = generation_inputs(input_ids, past_key_values, attention_mask, position_ids, use_cache)
        if past_key_values is None:
            self._image_layout = None
            if images is not None and len(images):
                rows = image_rows if image_rows is not None else torch.arange(input_ids.shape[0])
                self._image_layout = (input_ids.shape[1], rows.tolist(), input_ids)
                inputs.update(images=images, image_rows=image_rows)
        elif self._image_layout is not None:  # the cache holds the spliced prompt: widen the mask to match
            mask = inputs["attention_mask"]
            inputs["attention_mask"] = self._spliced_mask(mask, past_key_values[0][0].shape[2] + 1)
        return inputs

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


__all__ = ["ChatGLMForConditionalGeneration", "ChatGLMModel", "GLMBlock", "GLMPreTrainedModel"]
