"""Will an N-GPU job fit? The probe rehearses rank 0 of the planned world in this one process.

    python -m glmtune mode=probe +hw=a100_80g dist.nproc_per_node=8 model.path=...   # one GPU (or CPU), 8 planned

A probe can only measure the processes it runs on, so a plan for 8 GPUs on 2 nodes was certified only once the 8
GPUs were paid for. A rehearsal makes this process rank 0 of the planned world, `dist.nnodes x
dist.nproc_per_node` ranks, over a process group whose collectives move no data (train/rehearsal.py: torch's fake
group's rule, with results DDP can wait on, initialised with torch's FakeStore): every group the run creates
exists (the sequence-parallel groups, DeepSpeed's, DDP's), every collective returns at once, and rank 0's program
runs every kernel at its real shape — its 1/N of each ZeRO-3 partition (DeepSpeed 0.19.8 initialises and steps on
the group), its 1/SP of every row, its share of the batches. The probe measures each phase exactly as a real
probe does (train/phases.py) and its ladder acts on the rehearsed peak as on a real one. Time: one rank's steps.
On CPU the rehearsed peak equals rank 0's of a real gloo launch to the byte (tests/probe/test_rehearse.py).

`probe.rehearse`: `auto` rehearses when the plan's world is larger than the processes running (one process,
no launcher); `true` also rehearses a world of one; `false` plans for the processes there are, as before.

What a rehearsal's collectives do not allocate is added by name (`added_terms`): on a GPU, NCCL's communicator
(the estimator's figure, measured under DeepSpeed on an H100: plan/estimate.py NCCL_PER_GPU), which a real
probe sees through NVML. ZeRO-3's all-gather and prefetch buckets are DeepSpeed's own tensors, allocated before
the collective fills them, so they are measured, not added. Values stay finite (an all-gather repeats this
rank's input) and the row layout sequence-parallel attention gathers is the real one; the probe stops on memory,
never on a loss. What no rehearsal sees is said in one line (UNSEEN).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ..config import ConfigError

UNSEEN = (
    "a rehearsal measures rank 0 alone: it cannot see the other ranks' host RAM (the plan's host budget "
    "counts them) nor the links' speed (its collectives move no data; its seconds are one rank's compute)"
)


def added_terms(zero_stage: int, world: int, on_gpu: bool) -> dict[str, int]:
    """Bytes a real rank holds that a rehearsal's collectives never allocate, by name."""
    from ..plan.estimate import NCCL_PER_GPU

    if on_gpu and (world > 1 or zero_stage == 3):  # as the estimator counts it
        return {"NCCL communicator (the estimator's H100 figure; a rehearsal has none)": NCCL_PER_GPU}
    return {}


def with_added(peaks: dict | None, detail: dict, added: dict[str, int]) -> tuple[dict | None, dict]:
    """A rehearsal's phase peaks with the bytes a real rank holds beyond them (added_terms) in each phase,
    as a real probe's NVML reading holds them; the rank's own measurement stays in detail."""
    detail["added_terms"] = added
    if peaks is None or not added:
        return peaks, detail
    extra = sum(added.values())
    detail["rank0_phase_peak_bytes"] = peaks
    first = detail.get("first_training_peak_bytes")
    detail["first_training_peak_bytes"] = None if first is None else first + extra
    peaks = {phase: value + extra for phase, value in peaks.items()}
    detail["phase_peak_bytes"] = peaks
    return peaks, detail


@contextmanager
def rehearsal_world(world: int, ranks_per_node: int):
    """This process as rank 0 of `world` ranks (`ranks_per_node` on its node) for the block: the rehearsal's process
    group and the environment a launcher would give rank 0; accelerate's and DeepSpeed's view of the world are
    reset on the way in and out, and the environment restored, so what runs after the block sees this process
    alone."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..train.rehearsal import BACKEND

    if dist.is_initialized():
        raise ConfigError("a rehearsal needs this process alone, and a process group is already running")
    saved = dict(os.environ)  # restored whole: a ZeRO-3 rung leaves ACCELERATE_USE_DEEPSPEED=true (transformers)
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(min(world, ranks_per_node)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT") or "29500",
    )  # never dialled: the store is fake
    # Without it accelerate (multi-CPU) would share the cores out over the N ranks, and keep torch at 1/N of its
    # threads after the rehearsal: rank 0 is the only rank here and takes every thread this process has.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    _reset_views()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        comm = sys.modules.get("deepspeed.comm.comm")  # DeepSpeed keeps its own references to the world's groups
        if comm is not None and comm.cdb is not None:
            comm.destroy_process_group()
        else:
            dist.destroy_process_group()
        _reset_views()
        os.environ.clear()
        os.environ.update(saved)


def deepspeed_on_rehearsal_group() -> None:
    """ZeRO-3 in a rehearsal: DeepSpeed's communication layer wraps the rehearsal's group under its own name (else
    accelerate would name it after the device's backend, nccl or gloo, when it builds the first engine)."""
    import deepspeed

    from ..train.rehearsal import BACKEND
    from ..train.zero3 import skip_shm_build

    skip_shm_build()
    deepspeed.init_distributed(dist_backend=BACKEND, auto_mpi_discovery=False, verbose=False)


def _reset_views() -> None:
    """Forget the world accelerate's singletons and DeepSpeed's communication layer recorded."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    comm = sys.modules.get("deepspeed.comm.comm")  # only when a run imported DeepSpeed
    if comm is not None:
        comm.cdb = None
