"""Infer: generation from base + adapter and merging (`generate.py`), device maps over several GPUs
(`devicemap.py`).

May import: glmtune.config, models, data. Imported by the CLI only.
"""
