"""Which attention a packed row runs (train.packed_attention): the rule the model applies on every forward
(docattention.py, masks.py) and the planner names in the plan (plan/packrows.py).

It imports nothing, so `mode=plan` reads the rule without the attention code: docattention.py needs
torch.compiler, whose first use imports torch._dynamo (~1 s of a ~3.5 s plan on 2 cores, bench/plan_import.py).
"""

from __future__ import annotations

# Longest row (positions, the whole row under sequence parallelism) that `auto` gives the dense mask, from the H200
# rows of bench/doc_attention.py (two GLM-4-9B blocks, bf16, forward + backward; bench/RESULTS.md §26): per-document
# SDPA was as fast at 2,048 positions (34.8 vs 35.8 ms) and faster from 4,096 on (67.4 vs 71.7 ms; 534 vs 978 ms
# at 32K), and never larger (the mask's bias adds 16 MiB at 4,096, 1 GiB at 32K). 2,048 keeps the packed
# 2,048-position rows the GPU memory rows were measured on (§0, §11) on the path they were measured on; above it the
# dense mask only costs. (CPU, fp32: the loop was faster at every length measured, 1,024-16,384.)
DENSE_MASK_MAX = 2048
PATHS = ("sdpa", "segments", "flex")  # dense boolean mask | per-document SDPA | FlexAttention block mask


def packed_path(requested: str, row_length: int) -> str:
    """The attention path of a packed row of `row_length` positions: `requested` itself unless it is auto, which
    gives the dense mask (sdpa) to rows up to DENSE_MASK_MAX positions and per-document SDPA (segments) above.
    (auto's FlexAttention choice is made before, by the trainer: it needs compiled blocks on CUDA.)"""
    if requested == "auto":
        return "sdpa" if row_length <= DENSE_MASK_MAX else "segments"
    if requested not in PATHS:
        raise ValueError(f"packed attention {requested!r}: use auto or one of {', '.join(PATHS)}")
    return requested
