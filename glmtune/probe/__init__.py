"""Probe: real optimizer steps on a worst-case batch, measured before training commits to a plan. Measured on every
rank (`probe.py`), or on rank 0 of a larger planned world, rehearsed in one process (`rehearse.py`), on the worst
batch the data can produce (`batch.py`); what it reports (`report.py`) and its table (`table.py`), the CPU
live-tensor check of the estimator (`track.py`), and failure diagnosis with exit codes (`diagnose.py`).

May import: glmtune.config, launch, models, data, plan, train. Imported by the modes only.
"""
