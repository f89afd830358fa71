"""Plan: the per-GPU memory estimator (`estimate.py`, no weights, no GPU) and the planner that picks dtype,
checkpointing, loss chunk, ZeRO-3, offload and batch from it (`planner.py`).

May import: glmtune.config, glmtune.models. Imported by probe, train and the CLI.
"""
