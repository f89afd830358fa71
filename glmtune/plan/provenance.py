"""What each term of a plan rests on: `measured` on a GPU, `CPU-verified`, or `derived`.

- measured: a row of bench/RESULTS.md §0 (one H100 80GB, 2026-11-23, bench/gpu_calib_2026-11-23.jsonl) ran this
  kind of configuration and its figure was compared with the term: bf16 weights, LoRA states, activations,
  the loss head, GLM-4V's tower, evaluation, the context, the reserve of both allocators, ZeRO-3 on one GPU.
- CPU-verified: tensor bytes checked on CPU against the same code (tests/plan/test_memory.py, test_quantize.py), never
  on a GPU: the quantized bases (bitsandbytes storage and working set).
- derived: worked out from the architecture or from documentation, never measured: ZeRO-3 across 2+ GPUs
  (sharded weights, gather buckets, NCCL), generation's KV cache, the cuBLAS workspaces, the context of GPU
  families other than Hopper.
A plan whose peak is within NEAR_BUDGET of the budget and includes a derived term says so: the probe is then
what stands between the plan and an out-of-memory error.
"""

from __future__ import annotations

from ..config.units import GIB

MEASURED = "measured (H100, bench/RESULTS.md §0)"
CPU_VERIFIED = "CPU-verified (tensor bytes on CPU)"
DERIVED = "derived (not measured)"
NEAR_BUDGET = 0.05
# Under sequence parallelism the per-token terms are taken at the shard's length and the exchange buffers added
# (plan/longctx.py): checked on CPU against live bytes of a 2-rank gloo run, never on GPUs.
SP_TERMS = (
    "activations kept for backward",
    "recomputed block (checkpointing)",
    "block backward working set",
    "logits and loss",
)
SP_SOURCE = CPU_VERIFIED


def term_sources(breakdown: dict[str, int], shape) -> dict[str, str]:
    """For each term of the breakdown, what it rests on, given the run shape it was estimated for."""
    multi = shape.world_size > 1
    quantized = shape.quantize != "none"
    out = {}
    for name in breakdown:
        if name.startswith("CUDA context"):
            source = MEASURED if "(measured)" in name else DERIVED
        elif name.startswith("cuBLAS") or name == "eval KV cache":
            source = DERIVED
        elif name.startswith(("ZeRO-3", "frozen weights (ZeRO-3", "NCCL")) or (
            shape.zero_stage == 3 and name.startswith("LoRA")
        ):
            source = DERIVED if multi else MEASURED
        elif getattr(shape, "sequence_parallel", 1) > 1 and name in SP_TERMS:
            source = SP_SOURCE
        elif quantized and name in (
            "frozen weights",
            "block backward working set",
            "activations kept for backward",
            "recomputed block (checkpointing)",
        ):
            source = CPU_VERIFIED
        elif getattr(shape, "mlp_tile_tokens", 0) and (
            name in ("block backward working set", "recomputed block (checkpointing)")
            or (name == "activations kept for backward" and not shape.gradient_checkpointing)
        ):
            source = CPU_VERIFIED  # the tiled MLP's terms: fitted on CPU live bytes only (plan/tiledmlp.py)
        else:
            source = MEASURED
        out[name] = source
    return out


def derived_near_budget(breakdown: dict[str, int], sources: dict[str, str], peak: int, budget: int | None) -> str:
    """'' or one sentence: the peak is within NEAR_BUDGET of the budget and rests on derived terms."""
    if budget is None or peak < (1 - NEAR_BUDGET) * budget:
        return ""
    derived = [n for n, s in sources.items() if s == DERIVED and breakdown[n] > 0]
    if not derived:
        return ""
    return (
        f"the peak ({peak / GIB:.2f} of {budget / GIB:.2f} GiB) is within {NEAR_BUDGET:.0%} of the budget "
        f"and rests on terms never measured on a GPU ({', '.join(derived)}): the probe measures them"
    )
