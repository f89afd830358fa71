"""Kernels: what every model family's decoder shares and no family owns. Grouped-query attention with its KV cache
and mask paths (`attention.py`, `masks.py`), per-document attention of packed rows (`docattention.py`) and the
rule that picks it (`attnpath.py`, light enough for the plan), Ulysses sequence parallelism (`ulysses.py`), the
norm, rotary embedding and block loop (`layers.py`), the tiled MLP (`tiling.py`) and the loss head
(`causal_lm.py`).

May import: nothing of glmtune. Imported by the families (models.chatglm, ...) and by plan/train for the
figures they share (the dense-mask length, the sequence group).
"""
