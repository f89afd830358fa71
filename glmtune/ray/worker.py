"""One Ray Train worker = one glmtune rank: `python -m glmtune <overrides> hydra.run.dir=<run dir>` as a child process.

The rank is exactly the process torchrun would start: Ray's context gives it RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, and the address of rank 0's node (MASTER_ADDR, which Ray's torch backend set); rank 0 picks a
free port there and Ray's own process group broadcasts it, since Ray's group holds MASTER_PORT already. The run dir
is on the run's shared storage, so a group that Ray restarts after losing a worker runs the same command there and
glmtune resumes from its last complete checkpoint; on a group of another size it re-plans for the new world (the
plan's elastic re-split, README "What the plan may change").

A child in its own process keeps every glmtune behaviour as it is under torchrun: its signal handling (Ray runs this
function in a thread, where Python installs no handler), Hydra, the allocator setting made before torch loads,
and the exit codes. It dies with its worker (PR_SET_PDEATHSIG, SIGKILL): when Ray kills a worker group, whatever
the ranks did since their last complete checkpoint is lost (train.save_minutes bounds it); a rank cannot save
alone, since a checkpoint is written by all ranks together.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..launch.exits import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_NO_FIT, EXIT_OOM, EXIT_TRANSFORMERS
from ..rundir.atomic import write_json
from ..rundir.lock import RunDirLock

# Exits a restart would only repeat (bad input, does not fit, out of memory, remote code, diverged): recorded in
# FINAL_FILE, so that the group Ray restarts ends at once and the driver exits with the code. Any other failure
# restarts the group (FailureConfig) to resume: a crash, NCCL (a peer died first), a rank killed by a signal, and a
# rank stopped by SIGTERM with a complete checkpoint (EXIT_INTERRUPTED: a node reclaimed).
FINAL_EXITS = (EXIT_BAD_INPUT, EXIT_NO_FIT, EXIT_OOM, EXIT_TRANSFORMERS, EXIT_DIVERGED)
FINAL_FILE = "final-exit.json"  # beside the run dir: {"exit_code", "line"} of a final exit, for a restarted group
LOCK_WAIT_S = 120  # a restarted group waits this long for the last group's ranks to let go of the run dir


class RankFailed(RuntimeError):
    """A rank that exited non-zero: raised so that Ray ends the worker group (and restarts it, within max_failures);
    carries the code and the rank's last glmtune line for the driver."""

    def __init__(self, rank: int, code: int, line: str):
        super().__init__(f"rank {rank}: glmtune exited {code}" + (f": {line}" if line else ""))
        self.rank, self.code, self.line = rank, code, line

    def __reduce__(self):  # raised in a Ray worker, re-raised in the driver
        return (RankFailed, (self.rank, self.code, self.line))


def run_rank(config: dict) -> None:
    """Ray Train's train_loop_per_worker: config = {"overrides": [...], "run_dir": path}."""
    import ray.train

    run_dir = Path(config["run_dir"])
    final = run_dir.parent / FINAL_FILE
    if final.exists():  # the group Ray restarted after a final exit: nothing to run, the driver reads the file
        return
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(ctx.get_local_rank()),
        "WORLD_SIZE": str(ctx.get_world_size()),
        "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
        "GROUP_RANK": str(ctx.get_node_rank()),
        "MASTER_PORT": str(rank0_port(rank)),
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for its ranks
    wait_for_free_run_dir(run_dir)
    code, line = run_child([sys.executable, "-m", "glmtune", *config["overrides"], f"hydra.run.dir={run_dir}"], env)
    if code == 0:
        return
    if code in FINAL_EXITS:  # the other ranks may wait for this one in a collective until their timeout: fail the
        write_json(final, {"exit_code": code, "line": line})  # group, and its restart (if any) ends at once
    raise RankFailed(rank, code, line)


def rank0_port(rank: int) -> int:
    """A free port on rank 0's node for glmtune's own process group, the same on every rank."""
    import torch.distributed as dist

    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)  # Ray's group (gloo on CPU, NCCL on GPU), set up before this function
    return port[0]


def wait_for_free_run_dir(run_dir: Path) -> None:
    """A group Ray restarts can start before the ranks of the last one are gone: their run dir locks say so."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while any(
        RunDirLock(run_dir, int(p.name.removeprefix(".lock.rank"))).held()
        for p in run_dir.glob(".lock.rank*")
        if p.name.removeprefix(".lock.rank").isdigit()
    ):
        if time.monotonic() > deadline:
            raise RankFailed(-1, 1, f"{run_dir} is still in use by the last worker group after {LOCK_WAIT_S} s")
        time.sleep(1)


def _die_with_worker() -> None:
    """In the child, before exec: SIGKILL when the worker's thread that started it ends (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def run_child(cmd: list[str], env: dict) -> tuple[int, str]:
    """Run the rank; its output goes to the worker's (which Ray shows on the driver). Returns the exit code and the
    rank's last glmtune line (`glmtune: error: ...`, `glmtune: stopped by ...`), for the driver's one line."""
    child = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1, preexec_fn=_die_with_worker
    )
    last = [""]

    def relay() -> None:
        for text in child.stderr:
            sys.stderr.write(text)
            if text.startswith("glmtune: "):
                last[0] = text.strip()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    code = child.wait()
    reader.join(timeout=10)
    return code, last[0]
