"""Data: validate every JSONL line (`validate.py`), encode, truncate and collate (`pipeline.py`), once per input
into a memory-mapped Arrow cache (`cache.py` keys and locks, `build.py` builds with datasets.map, `tokenized.py`
is the torch Dataset the Trainer reads); several train files mixed and a val set held out of them (`mixing.py`),
and the numbers of the data table (`stats.py`).

May import: glmtune.config, glmtune.models. Imported by the plan, probe, train and infer stages.
"""
