"""Long-context terms of the estimator: Ulysses sequence parallelism on the card (the node's host memory is
plan/host.py's).

Sequence parallelism (models/kernels/ulysses.py, dist.sequence_parallel = N): a rank keeps ceil(seq / N) tokens of every
row through embeddings, norms, the MLP, LoRA's saved inputs, the checkpointed block inputs and the loss, so all
of estimate.py's per-token terms take the local token count. Attention works on the whole row for heads / N query
heads: q, the GQA-expanded K and V, the output and the log-sum-exp are [heads / N, seq] each, the same bytes as
[heads, seq / N], so block_saved's attention terms hold at the local count too. What SP adds is the exchange: each
of q, k, v goes through one all-to-all (a contiguous send buffer and a receive buffer, then the reshaped result
the attention keeps), and the output and every gradient come back through another. With N > KV groups (GLM: 2)
each KV group is replicated before the exchange (N / groups copies), so k and v travel as N rows, not 2. The
exchange buffers are transient; what attention's backward adds on top of the MLP-bound working set is
attention_working (measured on CPU; bench/length_table.py uses exchange_bytes for the time they take).
"""

from __future__ import annotations

from ..models import GLMConfig
from .variants import BYTES


def degree(shape) -> int:
    return max(1, getattr(shape, "sequence_parallel", 1))


def shard_length(seq_len: int, n: int) -> int:
    """Positions of a row on one rank: the row padded to a multiple of N (train/sequence.shard_batch), cut N ways."""
    return -(-seq_len // max(1, n))


def local_seq(shape) -> int:
    return shard_length(shape.seq_len, degree(shape))


def local_tokens(shape) -> int:
    return shape.micro_batch * local_seq(shape)


def kv_rows(arch: GLMConfig, n: int) -> int:
    """KV heads' worth of rows that travel per token: the groups, or N once they are replicated (N > groups)."""
    return max(arch.kv_groups, n) if n > 1 else arch.kv_groups


def exchange_bytes(arch: GLMConfig, shape, tokens: int) -> int:
    """Send + receive buffers of one layer's q, k, v exchange (the reshaped results are attention's saved
    tensors, counted by block_saved): 2 x e x tokens x (heads + 2 x KV rows) x head size. 0 without SP."""
    n = degree(shape)
    if n == 1:
        return 0
    e, d = BYTES[shape.dtype], arch.kv_channels
    return 2 * e * tokens * (arch.num_attention_heads + 2 * kv_rows(arch, n)) * d


def attention_working(arch: GLMConfig, shape, tokens: int) -> int:
    """Transient bytes of one attention backward under SP: the output's gradient exchanged into heads, then
    SDPA's dq, dK and dV over the expanded heads: 4 x e x tokens x heads x head size (heads / N over the row).
    Measured on CPU (2 gloo ranks, tests/plan/test_longctx.py): an attention-bound model (f = 128, 12 heads x 64)
    peaked 3.9-4.0 MiB above the MLP-bound estimate at 1,024 local fp32 tokens, 3.8 such [tokens, heads x d]
    tensors over the MLP's 2.5; the exchange buffers (exchange_bytes) are freed before that peak. Without SP the
    MLP's working set (estimate.block_working) is the larger on every GLM: 0 here."""
    if degree(shape) == 1:
        return 0
    return 4 * BYTES[shape.dtype] * tokens * arch.num_attention_heads * arch.kv_channels
