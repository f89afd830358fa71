"""One rank of tests/models/test_ulysses.py, under `torchrun --nproc_per_node 4` on gloo (CPU).

Every rank builds the same tiny fp32 model and batch, computes the reference on the whole rows alone, then
the same rows under sequence parallelism over 2 ranks (two groups of 2) and over 4; GLM-4V through the whole
forward with images (merged, then cut). It writes, per case, the
largest differences in the logits of its tokens, the summed token loss and every parameter's gradient
(summed over the sequence group: each rank's gradient covers its own tokens) into OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration
from glmtune.models.kernels.ulysses import SequenceGroup, pad_and_shard, shard
from glmtune.models.loading import _FAMILY, TINY_ARCH

B, S, VOCAB = 2, 24, 128


def batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[0, 10:13] = -100
    out = dict(input_ids=ids, labels=labels)
    if packed:  # documents crossing the shard boundaries of both 2 and 4 ranks; pads (-1) at the end of row 1
        lengths = [[5, 9, 7, 3], [11, 8, 5]]
        seq, pos = torch.full((B, S), -1), torch.zeros(B, S, dtype=torch.long)
        for row, docs in enumerate(lengths):
            at = 0
            for i, n in enumerate(docs):
                seq[row, at : at + n], pos[row, at : at + n] = i, torch.arange(n)
                at += n
        out.update(seq_ids=seq, position_ids=pos)
        out["labels"] = out["labels"].masked_fill(seq < 0, -100)
    return out


def loss_sum(model, data, shifted_labels) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token-loss sum of these positions, their logits); labels already shifted to the token they predict."""
    hidden, _ = model.transformer(data["input_ids"], data.get("position_ids"), seq_ids=data.get("seq_ids"))
    logits = model.transformer.output_layer(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), shifted_labels.flatten(), ignore_index=-100, reduction="sum"), logits


def run_case(model, data, sp: SequenceGroup | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    # The target of position t is token t+1: shifted on the whole row, before sharding, so the last token of a
    # shard keeps its target (the first token of the next shard).
    shifted = torch.cat([data["labels"][:, 1:], torch.full((B, 1), -100)], dim=1)
    if sp is not None:
        data = {k: shard(v, sp) for k, v in data.items()}
        shifted = shard(shifted, sp)
    model.transformer.set_sequence_group(sp)
    loss, logits = loss_sum(model, data, shifted)
    loss.backward()
    loss, grads = summed_over_group(model, loss, sp)
    return loss, logits.detach(), grads


def summed_over_group(model, loss: torch.Tensor, sp: SequenceGroup | None):
    """(the loss, every parameter's gradient) summed over the group: each rank's gradient covers its own tokens."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    loss = loss.detach().clone()
    if sp is not None:
        dist.all_reduce(loss, group=sp.group)
        for g in grads.values():
            dist.all_reduce(g, group=sp.group)
    model.transformer.set_sequence_group(None)
    return loss, grads


BOI, EOI = 120, 121  # the tiny GLM-4V's image placeholder ids here: boi <X> eoi becomes boi + 4 patches + eoi
IMAGES = [(0, 5), (1, 2), (1, 12)]  # (row, boi position): row 1 holds two images, in two of its packed documents


def vision_batch(packed: bool) -> dict[str, torch.Tensor]:
    """batch(packed) with image placeholders (prompt positions: no target) and one 56 px image for each."""
    data = batch(packed)
    data["input_ids"][data["input_ids"] >= BOI] = 1  # placeholders only where an image goes
    for row, at in IMAGES:
        data["input_ids"][row, at : at + 3] = torch.tensor([BOI, 0, EOI])
        data["labels"][row, at : at + 3] = -100
    data["images"] = torch.randn(len(IMAGES), 3, 56, 56, generator=torch.Generator().manual_seed(3))
    data["image_rows"] = torch.tensor([row for row, _ in IMAGES])
    return data


def run_vision_case(model, data, sp: SequenceGroup | None):
    """The whole CausalLM forward with images (the merge inside): summed token loss, this rank's logits, grads."""
    model.zero_grad(set_to_none=True)
    model.transformer.set_sequence_group(sp)
    model.loss_reduction = "sum"
    out = model(**data)
    out.loss.backward()
    loss, grads = summed_over_group(model, out.loss, sp)
    return loss, out.logits.detach(), grads


def merged_mask(model, data, shape) -> torch.Tensor:
    """1 where the merged rows hold a token (text or patch), 0 on the pads the merge adds to shorter rows."""
    with torch.no_grad():
        mask = model.transformer.merge_images(
            data["input_ids"],
            None,
            data.get("position_ids"),
            None,
            None,
            data["images"],
            data["image_rows"],
            data.get("seq_ids"),
        )[2]
    return mask if mask is not None else torch.ones(shape, dtype=torch.long)


def vision_results(rank: int, pairs) -> dict[str, dict]:
    """GLM-4V: every rank merges the images into the whole rows, then keeps its shard (padded: 30 positions
    over 4 ranks); the patches' shared position ids come from the merge, not from the shard's offset."""
    results = {}
    torch.manual_seed(0)
    config = GLMConfig(
        **{**TINY_ARCH, **_FAMILY["glm4v"]},
        padded_vocab_size=VOCAB,
        torch_dtype="float32",
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    model = ChatGLMForConditionalGeneration(config).float()
    for packed in (False, True):
        data = vision_batch(packed)
        ref_loss, ref_logits, ref_grads = run_vision_case(model, data, None)
        for size in (2, 4):
            sp = SequenceGroup.of(pairs[rank // 2] if size == 2 else None)
            loss, logits, grads = run_vision_case(model, data, sp)
            ref_local = pad_and_shard(ref_logits, 0.0, sp)[:, : logits.shape[1]]
            # Compared where a token is: a pad's query row attends to every key (models/kernels/masks.build_attention_mask),
            # the sequence-parallel pads included; no loss ever reads it.
            real = pad_and_shard(merged_mask(model, data, ref_logits.shape[:2]), 0, sp).bool()
            results[f"glm4v packed={packed} sp={size}"] = differences(
                (loss, logits[real], grads), (ref_loss, ref_local[real], ref_grads)
            )
    return results


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def differences(mine, ref) -> dict:
    """Largest relative differences of (loss, logits, gradients) against the reference's, and missing grads."""
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = mine, ref
    return dict(
        loss=rel(loss, ref_loss),
        logits=rel(logits, ref_logits),
        grads=max(rel(grads[n], ref_grads[n]) for n in ref_grads),
        missing=sorted(set(ref_grads) - set(grads)),
    )


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for family in ("glm4", "chatglm3"):
        for heads in (4, 8):
            torch.manual_seed(0)
            config = GLMConfig(
                **{**TINY_ARCH, **_FAMILY[family], "num_attention_heads": heads},
                padded_vocab_size=VOCAB,
                torch_dtype="float32",
            )
            model = ChatGLMForConditionalGeneration(config).float()
            for packed in (False, True):
                data = batch(packed)
                ref_loss, ref_logits, ref_grads = run_case(model, data, None)
                for size in (2, 4):
                    sp = SequenceGroup.of(pairs[rank // 2] if size == 2 else None)
                    loss, logits, grads = run_case(model, data, sp)
                    ref_local = shard(ref_logits, sp)
                    results[f"{family} heads={heads} packed={packed} sp={size}"] = differences(
                        (loss, logits, grads), (ref_loss, ref_local, ref_grads)
                    )
            # Checkpointed blocks recompute their attention, exchanges included, in backward: every rank of a
            # group recomputes the same blocks in the same order, so the collectives pair up again.
            for reentrant in (False, True):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
                model.train()
                data = batch(True)
                sp = SequenceGroup.of(None)
                loss, logits, grads = run_case(model, data, sp)
                ref_loss, ref_logits, ref_grads = run_case(model, data, None)
                results[f"{family} heads={heads} packed=True sp=4 checkpointing reentrant={reentrant}"] = differences(
                    (loss, logits, grads), (ref_loss, shard(ref_logits, sp), ref_grads)
                )
                model.gradient_checkpointing_disable()
    results.update(vision_results(rank, pairs))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(world=world, results=results), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
