"""The bundled sample sets (data/samples*/) and the one rule that ties their two files together: the sample val
set is paired with the sample train set only.

`python -m glmtune` (the demo) trains on data/samples/train.jsonl and evaluates on data/samples/val.jsonl. A run on
the user's own `data.train_file` is evaluated on their `data.val_file`, on `data.val_size` held out of their train
files, or on nothing (the header says which): never on the samples, whose loss would otherwise decide
`adapter_best/` and early stopping for a model trained on other data.

The rule is `data.val_file`'s value in conf/data/samples*.yaml, `${glmtune_sample_val:${.train_file},${.val_size}}`,
so it holds wherever a train file comes from (the command line, a sweep's trial, a config of the user's, every
torchrun rank) while a `data.val_file=...` given anywhere replaces it. The resolver is registered on import of
glmtune.config, before any composition reads it (the CLI, the tests' compose calls).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

SAMPLE_SETS = ("samples", "samples_vision")  # folders of data/ (and of glmtune/data/ inside a wheel)


def sample_val_file(train_file: Any, val_size: Any) -> str | None:
    """data.val_file of the sample data configs: a sample set's val file when `train_file` is that set's train file
    as the config names it and no data.val_size holds a val set out; otherwise None (no val file)."""
    if not isinstance(train_file, str) or val_size:
        return None
    for name in SAMPLE_SETS:
        if train_file == f"data/{name}/train.jsonl":
            return f"data/{name}/val.jsonl"
    return None


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("glmtune_sample_val", sample_val_file, replace=True)
