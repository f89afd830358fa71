"""Who this process is in a launch: rank, world size, the run dir name all ranks agree on, SLURM tasks.

    python -m glmtune ...                                                   # one process
    scripts/torchrun.sh 4 +hw=rtx4090_24g ...   # one node, 4 GPUs: torchrun --standalone under glmtune.supervise
    scripts/torchrun_multinode.sh        # several nodes: torchrun agents meeting at a c10d rendezvous
    scripts/deepspeed_launch.sh          # several nodes: the deepspeed launcher (--no_local_rank, hostfile)
    python -m glmtune -m hydra/launcher=slurm ...   # SLURM via hydra-submitit-launcher (conf/hydra/launcher)

Every launch runs Hydra inside each rank. The ranks agree on one run dir (`run_name`), each logs to
its own `rank<N>.log`, and only rank 0 writes shared files. Under SLURM no torchrun runs inside the
job: srun starts one task per GPU and `export_slurm_env` turns SLURM's variables into torch's.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import socket
import sys
from datetime import datetime

# A launch's own name for the run, first found wins: glmtune's, a Kubeflow TrainJob's name where the runtime exposes
# one (the emitted TrainJob sets GLMTUNE_RUN_ID to it: scale/trainjob.py), torchrun's rendezvous id.
RUN_IDS = ("GLMTUNE_RUN_ID", "TRAINJOB_NAME", "TORCHELASTIC_RUN_ID")
# torchrun --standalone names a launch with a random uuid4 (32 hex digits, with or without dashes).
_UUID = re.compile(r"^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_name(now: str) -> str:
    """Hydra's resolver: `_run_name` for this launch's environment. Cached per (now, ids) because Hydra resolves
    the dir more than once and a unique name must come out the same each time; keyed on the ids so a process
    whose environment changes (a test, a sweep) gets its new name."""
    ids = tuple(os.environ.get(v) for v in (*RUN_IDS, "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID"))
    return _run_name(now, ids)


@functools.lru_cache(maxsize=None)
def _run_name(now: str, ids: tuple) -> str:
    """The run dir's last part, identical on every rank of one launch, and never shared by two launches.

    torchrun gives every worker the same TORCHELASTIC_RUN_ID (a fresh id under --standalone, --rdzv_id
    otherwise; "none" under a static rendezvous such as a TrainJob's PET_* variables); other launchers set
    GLMTUNE_RUN_ID (or TRAINJOB_NAME) or pass hydra.run.dir. `now` is "DATE/TIME". A --standalone
    uuid becomes "DATE/torchrun-<first 8 hex digits>": readable, and still the same on every rank (the time of
    day is not: workers start a second apart). Tasks of one SLURM job step share its ids, and a requeued
    (pre-empted) job gets the same ids back, so it lands in its own run dir and resumes. A lone process gets
    `unique_run_name`. Cached: Hydra resolves the dir more than once.
    """
    for var in RUN_IDS:
        value = os.environ.get(var)
        if value and value != "none":
            if _UUID.match(value.lower()):
                return f"{now.split('/')[0]}/torchrun-{value.replace('-', '')[:8]}"
            return value
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}" + (
            f".{os.environ['SLURM_STEP_ID']}" if os.environ.get("SLURM_STEP_ID") else ""
        )
    return unique_run_name(now)


def unique_run_name(now: str) -> str:
    """`now` (date/time to the second) plus milliseconds and a random short id: two launches in the same
    millisecond still differ (1 in 65,536 per pair), and a listing still sorts by start time."""
    return f"{now}.{datetime.now().microsecond // 1000:03d}-{secrets.token_hex(2)}"


def export_slurm_env() -> bool:
    """Inside a task that srun started (the submitit launcher, or `srun python -m glmtune` in an sbatch
    script), set torch's env:// variables from SLURM's, as submitit's TorchDistributedEnvironment does.

    Does nothing under torchrun or deepspeed (RANK is already set) and for a single task. Returns whether
    it exported. CUDA_VISIBLE_DEVICES is left alone: each task sees the node's GPUs and the Trainer picks
    cuda:LOCAL_RANK, which a one-GPU mask per task would turn into a missing device.
    """
    env = os.environ
    if "RANK" in env or "SLURM_JOB_ID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    from submitit.slurm.slurm import SlurmJobEnvironment  # the [slurm] extra; parses "gpu[07-08],cpu3"

    tasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    env.update(
        RANK=env["SLURM_PROCID"],
        LOCAL_RANK=env["SLURM_LOCALID"],
        WORLD_SIZE=str(tasks),
        LOCAL_WORLD_SIZE=str(tasks // nodes),
        MASTER_ADDR=SlurmJobEnvironment().hostnames[0],
        # the same port on every task without talking: derived from the job id (submitit's rule)
        MASTER_PORT=env.get("MASTER_PORT") or str(20000 + int(env["SLURM_JOB_ID"]) % 40000),
    )
    return True


def single_process_env() -> None:
    """DeepSpeed needs a process group even for one process; without a launcher's variables it falls back
    to MPI discovery (mpi4py). Give a lone process the env a 1-process torchrun would."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def close_process_group() -> None:
    """Tear down the default process group before the interpreter exits (the Trainer opens it and never closes it).
    Left to interpreter exit, gloo's background threads are destroyed while still joinable and a rank that has
    printed its result can abort ("terminate called without an active exception"); torchrun then waits out its
    exit barrier (300 s) and reports the launch failed. Never imports torch: mode=plan stays light, and a torch
    that was never imported has no group to close. A failed teardown after the run's result changes nothing."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the run's outcome is already decided and reported
        pass
