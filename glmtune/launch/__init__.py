"""Launch: a process of a launch. Who it is (`ranks.py`: rank, world size, the run name all ranks agree on, SLURM
tasks), how it stops on a signal (`signals.py`), how it ends: every exit code and the one line's prefixes
(`exits.py`), what it prints: the console and `fail` (`console.py`), what libraries may print (`quiet.py`), the
supervisor the launch scripts run torchrun and deepspeed under (`supervise.py`), and the progress a Kubeflow
TrainJob's controller asks its pods for (`trainjob_status.py`, a Trainer callback: the one module here that imports
transformers).

Imports nothing else of glmtune, so every stage may ask it who this process is.
"""

from .ranks import (  # noqa: F401
    close_process_group,
    export_slurm_env,
    rank,
    run_name,
    single_process_env,
    unique_run_name,
    world_size,
)
