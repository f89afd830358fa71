"""Which attention a packed row runs (train.packed_attention): the rule the model applies on every forward
(models/docattention.py, modeling_glm4.py) and the planner names in the plan (plan/packrows.py).

It imports nothing, so `mode=plan` reads the rule without the attention code: models/docattention.py needs
torch.compiler, whose first use imports torch._dynamo (~1 s of a ~3.5 s plan on 2 cores, bench/plan_import.py).
"""
from __future__ import annotations

# Longest row (positions, the whole row under sequence parallelism) that `auto` gives the dense mask. Up to it the
# mask costs little: 16 MiB a row and 32 MiB of bf16 bias a block at 4,096, beside the GiBs of a 9B step there,
# and it is the path the GPU memory rows were measured on (bench/RESULTS.md: packed rows of 2,048 positions), one
# kernel call a block instead of one per document. Above it the mask grows with S^2 (1 GiB at 32K, 16 GiB at 128K)
# while the loop's cost grows with the documents. On CPU (bench/doc_attention.py, tiny GLM-4, fp32) the loop was
# faster at every length measured, 1,024-16,384 positions in documents of 512 and of 2,048: speed does not argue
# for the mask there; the measured GPU rows it keeps valid do. Per-document SDPA on a GPU is not measured yet.
DENSE_MASK_MAX = 4096
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
