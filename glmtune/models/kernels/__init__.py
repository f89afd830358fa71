"""What every model family's decoder shares and no family owns: Ulysses sequence parallelism (`ulysses.py`),
attention masks (`masks.py`), per-document attention of packed rows (`docattention.py`) and the tiled MLP
(`tiling.py`).

May import: nothing of glmtune. Imported by the families (models.chatglm, ...) and by plan/train for the
figures they share (the dense-mask length, the sequence group).
"""
