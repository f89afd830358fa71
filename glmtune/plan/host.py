"""The plan's second budget: one node's host RAM. What a node holds (`host_breakdown`), what it may use
(`host_budget`: hw.host_memory_gib, else this machine's MemAvailable from `available_ram`), and how the plan
reports both (plan.json's `host` block, the reason line, the table's rows).

What a node holds: the checkpointed block inputs offloaded to pinned memory (torch's caching host allocator
rounds each block up to a power of two), ZeRO-3's parameter and optimizer offload, the tokenized data
(memory-mapped, one copy per node) and each rank's process. A plan whose card part fits and whose host part
does not is refused. A CPU run has no card: its RAM is the budget of the whole estimate, checked again before
training (train/preflight.check_host_memory).
"""

from __future__ import annotations

import os

from ..config import RunConfig
from ..config.units import GIB
from ..models import GLMConfig
from .longctx import local_tokens
from .variants import BYTES

HOST_MARGIN = 0.9  # of the node's RAM a plan may use; the rest is the OS, page cache, the launcher
# Host RSS of one training process, bytes. 0.42 GiB measured here for glmtune's training imports (torch 2.13 CPU
# build, transformers, deepspeed; VmRSS, 2026-11-26); a CUDA process adds ~1.7 GB when CUDA first runs (pytorch
# issue #113326: 2,056,600 kB max RSS after the first CUDA tensor vs 322,040 kB without). Rounded up to 2.5 GiB for
# the Trainer, the data loader and NCCL's host buffers. UNCALIBRATED on a GPU node (no GPU lent when written).
PROCESS_HOST_BYTES = int(2.5 * GIB)
DATA_BYTES_PER_TOKEN = 16  # input_ids and labels as Arrow int64 (Python ints), memory-mapped


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
    """Bytes this machine can hand out without swapping: MemAvailable, else its physical memory; None when the
    system says neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB in /proc/meminfo
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def host_budget(host_memory_gib: float | None, this_machine: bool) -> tuple[int | None, str]:
    """The node's RAM budget in bytes and where it came from. Unset, it is this machine's MemAvailable when the
    plan is for this machine's own device (no hw.memory_gib); a plan for a card named by hw.memory_gib alone is
    for some other node, whose RAM nothing here knows: unchecked (None)."""
    if host_memory_gib is not None:
        return int(host_memory_gib * GIB * HOST_MARGIN), f"hw.host_memory_gib={host_memory_gib:g} x {HOST_MARGIN}"
    if not this_machine:
        return None, "not checked: hw.memory_gib names another machine's card; set hw.host_memory_gib for its RAM"
    ram = available_ram()
    if ram is None:
        return None, "unknown (no /proc/meminfo): set hw.host_memory_gib"
    return int(ram * HOST_MARGIN), f"this machine's MemAvailable {ram / GIB:.1f} GiB x {HOST_MARGIN}"


def host_figures(est, run: RunConfig, gpu_plan: bool) -> dict:
    """plan.json's host block: one node's bytes, its budget, whether it fits, and the terms."""
    budget, source = host_budget(run.hw.host_memory_gib, run.hw.memory_gib is None)
    used = sum(est.host.values())
    # A CPU run's RAM is its card budget: this machine's MemAvailable is checked before training
    # (train/preflight.py); a hw.host_memory_gib given for it must hold the estimate as well as the host terms.
    checked = budget is not None and (gpu_plan or run.hw.host_memory_gib is not None)
    if not gpu_plan:
        used += est.peak_bytes
    return {
        "bytes": used,
        "budget_bytes": budget,
        "budget_source": source,
        "fits": not checked or used <= budget,
        "breakdown": dict(est.host),
    }


def host_reason(host: dict, ranks: int) -> str:
    """The plan's `host` reason line: one node's bytes against its budget."""
    budget = "unknown" if host["budget_bytes"] is None else f"{host['budget_bytes'] / GIB:.1f} GiB"
    return (
        f"{host['bytes'] / GIB:.1f} GiB for {ranks} process(es) on a node, budget {budget} "
        f"({host['budget_source']})" + ("" if host["fits"] else ": DOES NOT FIT")
    )


def host_rows(host: dict) -> list[tuple[str, str, str]]:
    """The plan table's host rows: each term per node, then the total against its budget."""
    if not host:
        return []
    hb = host["budget_bytes"]
    rows = [(f"host: {name}", f"{value / GIB:.2f} GiB", "per node") for name, value in host["breakdown"].items()]
    rows.append(
        (
            "[bold]host RAM per node",
            f"[bold]{host['bytes'] / GIB:.2f} GiB",
            f"budget {'unknown' if hb is None else f'{hb / GIB:.1f} GiB'}: {host['budget_source']}"
            + ("" if host["fits"] else " — DOES NOT FIT"),
        )
    )
    return rows


def set_tokens(stats) -> int:
    """Tokens of the tokenized train and val splits (data/stats.DataStats), for the host budget."""
    return stats.train.tokens + (stats.val.tokens if stats.val is not None else 0)
