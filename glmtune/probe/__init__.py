"""Probe: real optimizer steps on a worst-case batch, measured on every rank (`probe.py`) — or on rank 0 of a
larger planned world, rehearsed in one process (`rehearse.py`) — its table (`table.py`), the CPU live-tensor
tracker it measures with (`track.py`), and failure diagnosis with exit codes (`diagnose.py`).

May import: glmtune.config, models, data, plan, train. Imported by the CLI only.
"""
