"""Data: validate every JSONL line (`validate.py`), then encode, truncate and collate (`pipeline.py`).

May import: glmtune.config, glmtune.models. Imported by the plan, probe, train and infer stages.
"""
