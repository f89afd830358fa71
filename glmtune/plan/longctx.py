"""Long-context terms of the estimator: Ulysses sequence parallelism on the card and the node's host memory.

Sequence parallelism (models/ulysses.py, dist.sequence_parallel = N): a rank keeps ceil(seq / N) tokens of every
row through embeddings, norms, the MLP, LoRA's saved inputs, the checkpointed block inputs and the loss, so all
of estimate.py's per-token terms take the local token count. Attention works on the whole row for heads / N query
heads: q, the GQA-expanded K and V, the output and the log-sum-exp are [heads / N, seq] each, the same bytes as
[heads, seq / N], so block_saved's attention terms hold at the local count too. What SP adds is the exchange: each
of q, k, v goes through one all-to-all (a contiguous send buffer and a receive buffer, then the reshaped result
the attention keeps), and the output and every gradient come back through another. With N > KV groups (GLM: 2)
each KV group is replicated before the exchange (N / groups copies), so k and v travel as N rows, not 2. The
exchange buffers are transient; what attention's backward adds on top of the MLP-bound working set is
attention_working (measured on CPU; bench/length_table.py uses exchange_bytes for the time they take).

Host memory per node (hw.host_memory_gib, the plan's second budget): the checkpointed block inputs offloaded to
pinned memory (torch's caching host allocator rounds each block up to a power of two), ZeRO-3's parameter and
optimizer offload, the tokenized data (memory-mapped, one copy per node) and each rank's process.
"""
from __future__ import annotations

import os

from ..models import GLMConfig
from .variants import BYTES

HOST_MARGIN = 0.9  # of the node's RAM a plan may use; the rest is the OS, page cache, the launcher
# Host RSS of one training process, bytes. 0.42 GiB measured here for glmtune's training imports (torch 2.13 CPU
# build, transformers, deepspeed; VmRSS, 2026-11-26); a CUDA process adds ~1.7 GB when CUDA first runs (pytorch
# issue #113326: 2,056,600 kB max RSS after the first CUDA tensor vs 322,040 kB without). Rounded up to 2.5 GiB for
# the Trainer, the data loader and NCCL's host buffers. UNCALIBRATED on a GPU node (no GPU lent when written).
PROCESS_HOST_BYTES = int(2.5 * 2**30)
DATA_BYTES_PER_TOKEN = 16  # input_ids and labels as Arrow int64 (Python ints), memory-mapped


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
    Measured on CPU (2 gloo ranks, tests/test_longctx.py): an attention-bound model (f = 128, 12 heads x 64)
    peaked 3.9-4.0 MiB above the MLP-bound estimate at 1,024 local fp32 tokens, 3.8 such [tokens, heads x d]
    tensors over the MLP's 2.5; the exchange buffers (exchange_bytes) are freed before that peak. Without SP the
    MLP's working set (estimate.block_working) is the larger on every GLM: 0 here."""
    if degree(shape) == 1:
        return 0
    return 4 * BYTES[shape.dtype] * tokens * arch.num_attention_heads * arch.kv_channels


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length() if x > 0 else 0


def host_breakdown(arch: GLMConfig, shape, frozen: int, p_lora: int, ranks: int, data_tokens: int) -> dict[str, int]:
    """Bytes one node holds in RAM: `ranks` processes of `shape` (its ZeRO shard over shape.world_size)."""
    e = BYTES[shape.dtype]
    out: dict[str, int] = {}
    if shape.gradient_checkpointing and shape.offload_checkpoints:
        # torch's CachingHostAllocator rounds every pinned block up to a power of two (ATen/core/
        # CachingHostAllocator.h, torch 2.13: PowerOf2Ceil below pinned_max_round_threshold, unlimited by default)
        block = _pow2(e * local_tokens(shape) * arch.hidden_size)
        out["pinned checkpoint offload"] = arch.num_layers * block * ranks
    n = max(1, shape.world_size) if shape.zero_stage == 3 else 1
    if shape.zero_stage == 3 and shape.offload_params:
        out["ZeRO-3 parameter offload"] = frozen * e // n * ranks
    if shape.zero_stage == 3 and shape.offload_optimizer:
        out["ZeRO-3 optimizer offload"] = p_lora * 16 // n * ranks  # fp32 master, Adam m, v, gradient
    if data_tokens:
        out["tokenized data (memory-mapped)"] = data_tokens * DATA_BYTES_PER_TOKEN
    out["processes (torch, CUDA runtime)"] = PROCESS_HOST_BYTES * ranks
    return out


def available_ram() -> int | None:
    """MemAvailable of this machine (what the kernel can hand out without swapping); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def host_budget(host_memory_gib: float | None, this_machine: bool) -> tuple[int | None, str]:
    """The node's RAM budget in bytes and where it came from. Unset, it is this machine's MemAvailable when the
    plan is for this machine's own device (no hw.memory_gib); a plan for a card named by hw.memory_gib alone is
    for some other node, whose RAM nothing here knows: unchecked (None)."""
    if host_memory_gib is not None:
        return int(host_memory_gib * 2**30 * HOST_MARGIN), f"hw.host_memory_gib={host_memory_gib:g} x {HOST_MARGIN}"
    if not this_machine:
        return None, "not checked: hw.memory_gib names another machine's card; set hw.host_memory_gib for its RAM"
    ram = available_ram()
    if ram is None:
        return None, "unknown (no /proc/meminfo): set hw.host_memory_gib"
    return int(ram * HOST_MARGIN), f"this machine's MemAvailable {ram / 2**30:.1f} GiB x {HOST_MARGIN}"
