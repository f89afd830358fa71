"""Infer: generation from base + adapter (`generate.py`), the merged export that loads elsewhere (`export.py`),
where an export may write: never over an input, only over an earlier export (`targets.py`), device maps over
several GPUs (`devicemap.py`).

May import: glmtune.config, rundir, models, data, plan. Imported by run/modes.py only.
"""
