"""python -m glmtune [+hw=CARD] [group=option ...] [key=value ...]

compose (Hydra) -> validate config and every data line -> plan -> train. See README.md for launches.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, parse_config
from .data import DataCollator, build_datasets, format_stats, validate_files
from .models import load_tokenizer
from .models.presets import resolve_model_dir
from .plan import default_choices
from .dist import rank, run_name, world_size
from .rundir import console, fail, print_config, write_run_files
from .train import train


# Every rank of one launch must agree on the run dir; ${now:} alone would differ by a second.
OmegaConf.register_new_resolver("glmtune_run", run_name, replace=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run = parse_config(OmegaConf.to_container(cfg, resolve=True))
        validate_files(run.data)  # every line of every file, before any weights load
        model_dir = resolve_model_dir(run.model)
        tokenizer = load_tokenizer(model_dir)
        train_set, val_set, stats = build_datasets(run.data, tokenizer)
    except (ConfigError, ValueError, OSError) as err:
        fail(str(err))
    write_run_files(run_dir, OmegaConf.to_yaml(cfg), list(HydraConfig.get().overrides.task), model_dir)
    print_config(run, run_dir)
    if rank() == 0:
        console.print(format_stats(stats))
    decisions = default_choices(run, world_size())
    metrics, _ = train(run, decisions.choices, run_dir, model_dir, train_set, val_set,
                    DataCollator(tokenizer.pad_token_id))
    if rank() == 0:
        console.print(f"adapter saved to {metrics['adapter_dir']}  (train loss {metrics['train_loss']:.4f})")
    return metrics["train_loss"]


if __name__ == "__main__":
    main()
