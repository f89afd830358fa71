"""Data: every line of every file checked, encoded once into a memory-mapped cache, and laid into batches. Files read
as raw records (`sources.py`: JSONL, JSON, Parquet, a saved dataset), other tools' formats mapped onto GLM messages
(`formats.py`), every line validated (`validate.py`, each message in `messages.py`, images in `images.py`), encoded,
truncated and collated (`pipeline.py`), once per input into a memory-mapped Arrow cache (`cache.py` keys and locks,
`build.py` builds with datasets.map, `tokenized.py` is the torch Dataset the Trainer reads); several train files
mixed and a val set held out of them (`mixing.py`), the examples of a micro-step packed into fuller rows
(`packing.py`), and the numbers of the data table (`stats.py`).

May import: glmtune.config, glmtune.models. Imported by the plan, probe, train and infer stages.
"""
