"""Ulysses sequence parallelism for GLM attention: each rank of a group of N holds seq/N tokens everywhere but
inside attention, where an all-to-all trades the sequence shard for a head shard and back.

Around attention a rank of the group holds, for its 1/N of the query heads, the whole sequence: attention is
then the ordinary (causal or per-document) attention over all positions, computed exactly as on one process.
Embeddings, norms, the MLP and the loss only ever see the rank's own tokens, so activation memory is 1/N.

KV heads: GLM-4, GLM-4V and ChatGLM3 have 32 query heads over 2 KV groups. With N <= 2 (N dividing the groups)
each rank takes its N-th of the KV groups. With N > 2 a rank's query heads all read one KV group, and that
group is replicated before the exchange (N / groups copies, one per rank reading it); the copies' gradients
are summed by autograd (repeat_interleave's backward), so each group's gradient is counted once.

Positions stay global: the caller gives each rank the position ids of its own shard (rotary embedding is
applied before the exchange, per token). Masks are built for the whole sequence from the gathered seq ids or
padding mask (`gather_sequence`): they are [B, S] integers, cheap beside the activations.

Both exchanges are `all_to_all_single` of one contiguous buffer; each one's backward is the other exchange,
so gradients travel back along the same routes. gloo has all_to_all on CPU tensors (torch 2.13): the suite
runs this under torchrun on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceGroup:
    """The processes that share one sequence: `size` ranks, this one at `rank` (its shard's index)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> "SequenceGroup":
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def check_heads(self, heads: int, kv_groups: int) -> str | None:
        """Why this model's heads cannot be split over the group, or None."""
        if heads % self.size:
            return f"{heads} attention heads do not split over {self.size} ranks"
        if kv_groups % self.size and self.size % kv_groups:
            return f"{kv_groups} KV groups neither split over nor divide {self.size} ranks"
        return None


def _exchange(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """all_to_all_single over dim 0 of x [N, ...]: chunk j goes to rank j, the result's chunk j came from j."""
    x = x.contiguous()  # before empty_like: it would copy a permuted view's strides, the exchange writes dense
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _to_heads(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """[b, H, s/N, d] (all heads, this rank's tokens) -> [b, H/N, s, d] (this rank's heads, all tokens)."""
    b, h, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # chunk j: the heads rank j will own
    got = _exchange(chunks, sp)  # got[j]: my heads over rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _to_sequence(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """[b, H/N, s, d] -> [b, H, s/N, d]: the inverse of _to_heads."""
    b, h, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's tokens of my heads
    got = _exchange(chunks, sp)  # got[j]: rank j's heads over my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * h, s // n, d)


class _Exchange(torch.autograd.Function):
    """One of the two exchanges; its backward is the other one, along the same routes."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _to_heads(x, sp) if to_heads else _to_sequence(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return (_to_sequence(grad, ctx.sp) if ctx.to_heads else _to_heads(grad, ctx.sp)), None, None


def heads_for_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SequenceGroup):
    """q [b, heads, s/N, d], k and v [b, groups, s/N, d] -> this rank's query heads and the KV groups they
    read, each over the whole sequence: q [b, heads/N, s, d], k and v [b, max(groups/N, 1), s, d]."""
    groups = k.shape[1]
    if sp.size > groups:  # one KV group per rank: copy each group for the N/groups ranks whose heads read it
        k = k.repeat_interleave(sp.size // groups, dim=1)
        v = v.repeat_interleave(sp.size // groups, dim=1)
    return _Exchange.apply(q, sp, True), _Exchange.apply(k, sp, True), _Exchange.apply(v, sp, True)


def heads_to_sequence(out: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """Attention output [b, heads/N, s, d] -> [b, heads, s/N, d] for the output projection."""
    return _Exchange.apply(out, sp, False)


def gather_sequence(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """[B, s/N] ids or mask of this rank's tokens -> [B, s], no gradient (mask inputs only)."""
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)


NO_TARGET = -100  # the label of a position the loss skips (data.pipeline.IGNORE_INDEX; models sit below data)
# What a position added to make a row a multiple of N holds, per [B, S(, ...)] input: no target, no attention
# (mask 0), no document (data/packing.py's pad seq id -1), position 0 and token 0 as the collator pads.
PAD_FILL = {
    "labels": NO_TARGET,
    "input_ids": 0,
    "inputs_embeds": 0,
    "attention_mask": 0,
    "position_ids": 0,
    "seq_ids": -1,
}


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> each position's target (the next token's label), taken on the whole row so that the last
    token of a shard keeps the first token of the next shard as its target; the last position has none."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), NO_TARGET)], dim=1)


def pad_and_shard(x: torch.Tensor, fill: float, sp: SequenceGroup) -> torch.Tensor:
    """This rank's 1/N of dim 1 of x [B, S, ...], after right-padding S to a multiple of N with `fill` (right
    padding: under causal attention no real token sees it)."""
    pad = -x.shape[1] % sp.size
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1)
    if hasattr(sp.group, "remember"):  # a rehearsal's group (train/rehearsal.py) gathers the row's real layout
        sp.group.remember(x)
    return shard(x, sp)


def shard(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous 1/N of dim `dim` (its length must be a multiple of N)."""
    if x.shape[dim] % sp.size:
        raise ValueError(f"sequence length {x.shape[dim]} is not a multiple of the {sp.size} ranks sharing it")
    return x.chunk(sp.size, dim=dim)[sp.rank]
