"""Will an N-GPU job fit? The probe rehearses rank 0 of the planned world in this one process (issue 42).

    python -m glmtune mode=probe +hw=a100_80g dist.nproc_per_node=8 model.path=...   # one GPU (or CPU), 8 planned

A probe can only measure the processes it runs on, so a plan for 8 GPUs on 2 nodes was certified only once the 8
GPUs were paid for. A rehearsal makes this process rank 0 of the planned world, `dist.nnodes x
dist.nproc_per_node` ranks, over torch's fake process group (torch.testing._internal.distributed.fake_pg): every
group the run creates exists (the sequence-parallel groups, DeepSpeed's, DDP's), every collective returns at once
without moving data, and rank 0's program runs every kernel at its real shape — its 1/N of each ZeRO-3 partition,
its 1/SP of every row, its share of the batches. The probe then measures each phase exactly as a real probe does
(train/phases.py) and its ladder acts on the rehearsed peak as on a real one. Time: one rank's steps.

`probe.rehearse`: `auto` rehearses when the plan's world is larger than the processes running (one process,
no launcher); `true` also rehearses a world of one; `false` plans for the processes there are, as before.

What the fake group does not allocate is added as named terms (`added_terms`): on a GPU, NCCL's communicator
(the estimator's figure, measured under DeepSpeed on an H100: plan/estimate.py NCCL_PER_GPU), which a real
probe sees through NVML. ZeRO-3's all-gather and prefetch buckets are DeepSpeed's own tensors, allocated before
the collective fills them, so they are measured, not added. Values: the fake group fills every output with this
rank's input (an all-gather repeats it), so nothing becomes NaN; the row layout sequence-parallel attention
gathers is the real one (train/rehearsal.py). The probe never stops on a loss, only on memory.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ..config import ConfigError, RunConfig

UNSEEN = ("a rehearsal measures rank 0 alone: it cannot see the other ranks' host RAM (the plan's host budget "
          "counts them) nor the links' speed (its collectives move no data; its seconds are one rank's compute)")


def rehearsed_world(run: RunConfig, processes: int) -> int:
    """The ranks a mode=probe rehearses in this process, or 0 for a real probe of the `processes` running."""
    setting, planned = run.probe.rehearse, run.dist.nnodes * run.dist.nproc_per_node
    if setting is False:
        return 0
    if processes > 1:
        if setting is True:
            raise ConfigError(f"probe.rehearse=true rehearses a plan in one process, and this launch has {processes}: "
                              "run mode=probe without torchrun (dist.nproc_per_node=N names the GPUs it plans for), "
                              "or probe.rehearse=auto to probe the processes running")
        return 0
    return planned if setting is True or planned > 1 else 0


def added_terms(zero_stage: int, world: int, on_gpu: bool) -> dict[str, int]:
    """Bytes a real rank holds that a fake collective never allocates, by name."""
    from ..plan.estimate import NCCL_PER_GPU

    if on_gpu and (world > 1 or zero_stage == 3):  # as the estimator counts it
        return {"NCCL communicator (the estimator's H100 figure; a fake group allocates none)": NCCL_PER_GPU}
    return {}


@contextmanager
def fake_world(world: int, ranks_per_node: int):
    """This process as rank 0 of `world` ranks (`ranks_per_node` on its node) for the block: torch's fake process
    group and the environment a launcher would give rank 0; accelerate's and DeepSpeed's view of the world are
    reset on the way in and out, so the run after the block (or a test's next run) sees this process alone."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..train.rehearsal import BACKEND

    if dist.is_initialized():
        raise ConfigError("a rehearsal needs this process alone, and a process group is already running")
    saved = dict(os.environ)  # restored whole: a ZeRO-3 rung leaves ACCELERATE_USE_DEEPSPEED=true (transformers)
    os.environ.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(min(world, ranks_per_node)), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or "29500")  # never dialled: the store is fake
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


def deepspeed_on_fake_group() -> None:
    """ZeRO-3 in a rehearsal: DeepSpeed's communication layer wraps the fake group under its own name (without this
    accelerate would name it after the device's backend, nccl or gloo, on the first engine)."""
    import deepspeed

    from ..train.rehearsal import BACKEND

    deepspeed.init_distributed(dist_backend=BACKEND, auto_mpi_discovery=False, verbose=False)


def _reset_views() -> None:
    """Forget the world accelerate's singletons and DeepSpeed's communication layer recorded."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    comm = sys.modules.get("deepspeed.comm.comm")  # only when a run imported DeepSpeed
    if comm is not None:
        comm.cdb = None
