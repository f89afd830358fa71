"""Modes: one command after Hydra composed it, mode by mode. What every mode starts from (`prepare.py`), the modes
themselves, each a short function (`run.py`: plan, probe, infer, chat, serve; `train.py`: training and each way it
ends), what a person reads before and after (`report.py`), one process asked for several (`launched.py`), and a
sweep's trials, recorded one by one (`sweep.py`), stopped and continued by a signal (`sweepstop.py`).

May import every part of glmtune; only `glmtune/__main__.py` imports it.
"""
