"""Config: compose and validate. The command line before Hydra (`cli.py`), one composition for a plain run
(`compose.py`), the typed schema (`schema.py`), its validation into one ConfigError (`validate.py`; serve.* in
`serving.py`), and the user's own DeepSpeed JSON, read and checked against the run (`userds.py`: the plan reads its
ZeRO stage and offloads, the trainer the file itself), and the sample sets' val pairing, a resolver the data configs
name (`samples.py`: registered here, so any composition of conf/ can resolve it).

Imports nothing else of glmtune: every stage below receives these objects, and reads them from here.
"""
from .validate import (CONF_DIR, EVAL_METRICS, GROUPS, LORA_TARGETS, MODES, TRACKERS, ConfigError,  # noqa: F401
                       DataConfig, DistConfig, EvalConfig, HwConfig, InferConfig, LoraConfig, ModelConfig,
                       ProbeConfig, RunConfig, ServeConfig, TrainConfig, check_override_keys, parse_config,
                       train_files)
from .samples import SAMPLE_SETS, register_resolvers  # noqa: F401

register_resolvers()
