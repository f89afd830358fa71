"""Config: the command line checked and composed, then validated once into typed dataclasses. The command line before
Hydra (`cli.py`), one composition for a plain run (`compose.py`), the typed schema (`schema.py`), its validation
into one ConfigError (`validate.py`; the value rules in `values.py`, serve.* in `serving.py`, plan.* in
`planemit.py`), the user's own DeepSpeed JSON read and checked once into a typed value (`userds.py`), the sample
sets' val pairing, a resolver the data configs name (`samples.py`: registered here, so any composition of conf/ can
resolve it), and the units of memory every module counts in (`units.py`).

May import: glmtune.launch (the exit codes --help lists). Every stage below receives these objects and reads
them from here.
"""

from .samples import SAMPLE_SETS, register_resolvers  # noqa: F401
from .schema import (
    CONF_DIR,
    EVAL_METRICS,
    GROUPS,
    LORA_TARGETS,
    MODES,
    DataConfig,
    DistConfig,
    EvalConfig,
    HwConfig,
    InferConfig,
    LoraConfig,
    ModelConfig,
    ProbeConfig,
    RunConfig,
    ServeConfig,
    TrainConfig,
)
from .validate import ConfigError, check_override_keys, parse_config, read_json_object
from .values import TRACKERS, train_files

register_resolvers()
