"""Infer: generation from base + adapter and merging (`generate.py`), device maps over several GPUs
(`devicemap.py`).

May import: glmtune.config, rundir, models, data, plan. Imported by run/modes.py only.
"""
