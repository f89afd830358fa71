"""What every mode starts from: the validated config (and the user's DeepSpeed file, read once), the
architecture, and, except for mode=plan, the tokenizer and every data line. Every bad input is a ConfigError
(one line, exit 2) raised here, before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError, parse_config, userds
from ..data.packing import decide_packing
from ..data.pipeline import DataCollator, build_datasets, cache_entries
from ..launch import rank
from ..models import load_tokenizer
from ..models.presets import arch_config, resolve_model_dir
from ..models.weightfiles import check_weight_files
from ..plan.estimate import image_extra_tokens
from ..rundir.atomic import is_disk_full
from ..rundir.resume import input_fingerprints
from ..train.compile import check_attention
from .launched import check_launch


@dataclass
class Prepared:
    """What every mode starts from; `data`/`packing` only for the modes that train or probe."""

    cfg: DictConfig
    config: dict[str, Any]  # the resolved config, as recorded in run_state.json
    run: Any  # config_schema.RunConfig
    arch: Any
    overrides: list[str]
    user_ds: userds.UserDeepSpeed | None  # dist.deepspeed_config
    model_dir: Path | None = None
    tokenizer: Any = None
    data: Any = None
    packing: Any = None
    inputs: dict | None = None  # data, tokenizer and weight fingerprints a resume must find unchanged


def prepare(cfg: DictConfig, overrides: list[str]) -> Prepared:
    """Validate the config, read the architecture, and (except for mode=plan) the tokenizer and every data line."""
    config = OmegaConf.to_container(cfg, resolve=True)
    try:
        run = parse_config(config)
        user_ds = userds.load(run)  # dist.deepspeed_config, read and checked once, before anything loads
        run = userds.with_strategy(run, user_ds)  # its ZeRO stage decides dist.strategy=auto
        check_launch(run)  # dist.nproc_per_node=N without a launcher: exit 2 for mode=train (modes/launched.py)
        check_attention(run.train)
        prep = Prepared(cfg, config, run, arch_config(run.model), overrides, user_ds)  # config.json: no weights
        if run.mode != "plan":
            prep.model_dir = resolve_model_dir(run.model)
            check_weight_files(prep.model_dir)  # missing, truncated or pickled weights: one line now, not mid-load
            prep.tokenizer = load_tokenizer(prep.model_dir, thinking=run.data.thinking)
        if run.mode in ("train", "probe"):
            # Every line of every file is checked when its cache entry is built, before any weights load.
            data = build_datasets(run.data, prep.tokenizer, prep.arch.vision_config, seed=run.train.seed)
            # Read by rank 0 only (recorded at a first launch, compared at a resume): the weight files' sampled
            # content is hashed once per launch, not by every rank against the same disk.
            prep.inputs = input_fingerprints(cache_entries(data), prep.model_dir) if rank() == 0 else None
            prep.data = data  # packing never changes which examples a step trains: only how the collator lays them
            prep.packing = decide_packing(
                run.data,
                data.train,
                image_extra_tokens(prep.arch),
                run.train.per_device_batch_size,
                on_gpu=torch.cuda.is_available(),
            )
    except (ValueError, OSError) as err:  # bad input, or a device map that cannot place a tensor
        if is_disk_full(err):
            raise
        raise ConfigError(str(err)) from None
    return prep


def collator(prep: Prepared) -> DataCollator:
    return DataCollator(prep.tokenizer.pad_token_id, image_size=(prep.arch.vision_config or {}).get("image_size"))


def typed(overrides: list[str], key: str) -> bool:
    """Whether the command line set `key` (key=, +key= or ~key=)."""
    return any(o.lstrip("+~").startswith(f"{key}=") for o in overrides)
