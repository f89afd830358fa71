"""Run: one command after Hydra composed it. The modes, each a short function (`modes.py`), what a person reads
before and after (`report.py`), and a sweep's trials, recorded one by one (`sweep.py`).

May import every part of glmtune; only `glmtune/__main__.py` imports it.
"""
