"""The peak memory of each phase of a run — training steps, evaluations, saves — measured alike by the probe
and by the run, so the one certifies the other.

The probe's promise is that the run it precedes fits. It can only keep it if both are measured the same way
over the same phases: the probe runs the run's own Trainer (train/lora_trainer.py make_trainer) through the
same phases in the run's order (a training step, an evaluation, training again), and this meter, which
make_trainer installs in both, reads each phase's peak:

- on a GPU, the whole process as the plan predicts it: the allocator's peak reserve during the phase plus what
  the process holds outside the allocator (context, kernels, NCCL). The reserve never shrinks by itself, so an
  evaluation's peak includes the cache the training steps left, which is the fragmentation the run will see;
- on CPU, live tensor bytes (train/livebytes.py), weights and optimizer states included: the estimator's
  tensor terms, never the resident set, which a CPU process's allocator and libraries blur.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import TrainerCallback

from ..config.units import GIB
from .gpumem import outside_allocator_bytes
from .livebytes import LiveTensorTracker

PHASES = ("train", "eval", "save")


class PhaseMeter(TrainerCallback):
    """Per-phase peaks (bytes). `records`: every phase in order as (phase, step, bytes); `peaks`: the largest of
    each phase; `current`: the phase in progress (the one an out-of-memory error interrupted)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cuda = torch.cuda.is_available()
        self.records: list[tuple[str, int, int]] = []
        self.details: dict[str, dict] = {}  # CUDA: the largest train/eval phase's allocator figures
        self.current: str | None = None
        self.step = 0
        self.tracker = None
        if not self.cuda:
            # Under ZeRO-3 a parameter's data is a placeholder; its shard lives in ds_tensor.
            weights = [getattr(p, "ds_tensor", p) for p in model.parameters()] + list(model.buffers())
            self.tracker = LiveTensorTracker(baseline=weights)

    # A phase ------------------------------------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        self.current = phase
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the phase's peak is its own (the reserve it starts on included)
            return
        # The tracker is a dispatch mode: on torch's stack during a phase only, so nothing outside a phase (another
        # run in this process, a test) ever runs through it. Tensors it registered stay counted until freed.
        self.tracker.__enter__()
        self.tracker.reset_peak()

    def end(self) -> int:
        phase, self.current = self.current, None
        if self.cuda:
            torch.cuda.synchronize()
            reserved = torch.cuda.max_memory_reserved()
            peak = reserved + outside_allocator_bytes()
            if peak >= self.peaks().get(phase, 0):
                stats = torch.cuda.memory_stats()
                self.details[phase] = {
                    "peak_reserved_bytes": reserved,
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_active_bytes": stats.get("active_bytes.all.peak", 0),
                    "alloc_retries": stats.get("num_alloc_retries", 0),
                }
        else:
            peak = self.tracker.peak_bytes
            self.tracker.__exit__(None, None, None)
        self.records.append((phase, self.step, peak))
        return peak

    @contextmanager
    def phase(self, name: str):
        """A phase inside another (an evaluation the Trainer runs within a training step's bookkeeping) is
        measured as its own; the outer one resumes afterwards."""
        outer = self.current
        if outer is not None:
            self.end()
        self.begin(name)
        try:
            yield self
        finally:
            if self.current == name:
                self.end()
            if outer is not None:
                self.begin(outer)

    def __enter__(self) -> "PhaseMeter":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Ends a phase an exception interrupted (its tracker comes off the stack)."""
        if self.current is not None:
            self.end()

    # What was measured --------------------------------------------------------------------------------------
    def peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for phase, _, peak in self.records:
            out[phase] = max(out.get(phase, 0), peak)
        return out

    def peak(self) -> int | None:
        return max((p for _, _, p in self.records), default=None)

    def first_training_peak(self) -> int | None:
        """The training steps' peak before the first evaluation: what training alone needs."""
        first = [p for phase, _, p in _until_eval(self.records) if phase == "train"]
        return max(first, default=None)

    # The Trainer's loop -------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        self.begin("train")

    def on_step_end(self, args, state, control, **kwargs):
        if self.current == "train":
            self.end()


def _until_eval(records: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    out = []
    for record in records:
        if record[0] == "eval":
            break
        out.append(record)
    return out


def format_peaks(peaks: dict[str, int]) -> str:
    """'train 20.51, eval 20.76, save 20.10 GiB' in the run's order of phases."""
    return ", ".join(f"{p} {peaks[p] / GIB:.2f}" for p in PHASES if p in peaks) + " GiB"


def gathered_peaks(meter: PhaseMeter) -> dict[str, int]:
    """Each phase's largest peak over every rank (all ranks must call it: it is a collective when distributed)."""
    import torch.distributed as dist

    peaks = meter.peaks()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, peaks)
        peaks = {p: max(r.get(p, 0) for r in every) for p in PHASES if any(p in r for r in every)}
    return peaks


def estimated_phases(est) -> dict[str, int]:
    """The estimate (plan/estimate.py) of each phase measured here: training is the estimator's loss, backward
    and vision-tower phases, evaluation its loss-only forward (the probe generates nothing); each with its own
    allocator reserve and what the process holds outside its tensors, as the whole-process peak counts them."""
    outside = est.peak_bytes - est.phases[est.phase] - est.reserves.get(est.phase, 0)
    whole = {p: v + est.reserves.get(p, 0) + outside for p, v in est.phases.items()}
    out = {"train": max(whole[p] for p in ("loss", "backward", "vision") if p in whole)}
    if "eval" in whole:
        out["eval"] = whole["eval"]
    return out
