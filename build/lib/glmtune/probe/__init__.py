"""Probe: real optimizer steps on a worst-case batch, measured on every rank (`probe.py`), the CPU live-tensor
tracker it measures with (`track.py`), and failure diagnosis with exit codes (`diagnose.py`).

May import: glmtune.config, models, data, plan, train. Imported by the CLI only.
"""
