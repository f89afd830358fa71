"""A launch of one process that asks for several: dist.nproc_per_node x dist.nnodes > 1 under a plain
`python -m glmtune`, which no launcher started (torchrun, the deepspeed launcher and a multi-task SLURM job set
WORLD_SIZE in every rank; a plain launch sets none and is one process).

- mode=train stops with one line, exit 2, before any data or weights load: one process would train another run
  than the one asked for (its global batch, its ZeRO-3 shards sized for N GPUs, N times the hours) on one of the
  N GPUs, and the difference shows only after the hours are spent. The line says how to launch it.
- mode=plan plans the N-GPU run: planning a multi-GPU job without its GPUs or a launcher is what mode=plan is
  for (the plan's advice names dist.nproc_per_node=N options too); a closing line says how to launch it.
- mode=probe measures this one process and says so (a probe of the N-GPU plan in one process, a rehearsal, is
  planned: it will give the same command its meaning).
"""

from __future__ import annotations

import os
import textwrap

from ..config import ConfigError, DistConfig, RunConfig
from ..launch.console import LOG_WIDTH


def launched() -> bool:
    """Whether a launcher started this process (it set WORLD_SIZE), rather than a plain `python -m glmtune`."""
    return "WORLD_SIZE" in os.environ


def asked(dist: DistConfig) -> str:
    """The processes dist.* asks for, as the user wrote them."""
    return (
        f"dist.nnodes={dist.nnodes} x dist.nproc_per_node={dist.nproc_per_node}"
        if dist.nnodes > 1
        else f"dist.nproc_per_node={dist.nproc_per_node}"
    )


def how_to_launch(dist: DistConfig) -> str:
    if dist.nnodes > 1:
        return (
            f"NNODES={dist.nnodes} NPROC={dist.nproc_per_node} scripts/torchrun_multinode.sh <same overrides> "
            "on each node (README: distributed runs)"
        )
    return f"scripts/torchrun.sh {dist.nproc_per_node} <same overrides>"


def check_launch(run: RunConfig) -> None:
    """mode=train asking for several processes in a plain launch of one: ConfigError (exit 2)."""
    processes = run.dist.nnodes * run.dist.nproc_per_node
    if run.mode == "train" and processes > 1 and not launched():
        raise ConfigError(
            f"{asked(run.dist)} asks for {processes} processes; this launch is one — run {how_to_launch(run.dist)}"
        )


def launch_note(run: RunConfig) -> str | None:
    """mode=plan and mode=probe in a plain launch: what the N-process request means here, or None."""
    processes = run.dist.nnodes * run.dist.nproc_per_node
    if processes == 1 or launched():
        return None
    if run.mode == "plan":
        note = f"planned for {processes} GPUs ({asked(run.dist)}): train it with {how_to_launch(run.dist)}"
    elif run.mode == "probe" and run.probe.rehearse is False:  # auto/true rehearse rank 0 of those N here
        note = (
            f"the probe measures this one process, not the {processes} of {asked(run.dist)}: probe those with "
            f"{how_to_launch(run.dist)} mode=probe"
        )
    else:
        return None
    return textwrap.fill(note, LOG_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
