"""Memory per optimizer step, saved with every run as memory_timeline.png (+ .json with the numbers).

On a GPU: allocated and reserved bytes and their peaks since the previous step, and the whole process's peak
(peak reserve + what NVML sees outside the allocator: context, kernels, NCCL), which is what the plan
predicts; the plot draws the planned peak and the card's budget beside it, so the margin shows at a glance.
On CPU there is no caching allocator to read, so the process's resident set size stands in; the plot says
which it shows.
"""

from __future__ import annotations

import io
import json
import resource
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..config.units import GIB
from ..rundir.atomic import write_bytes, write_text
from .gpumem import outside_allocator_bytes


def _sample() -> dict[str, float]:
    if torch.cuda.is_available():
        sample = {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
        }
        sample["peak_process"] = sample["peak_reserved"] + outside_allocator_bytes()
        torch.cuda.reset_peak_memory_stats()  # so each step's peak is its own
        return sample
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _peak_key(sample: dict) -> str:
    return "peak_process" if "peak_process" in sample else "peak_rss"


class MemoryTimeline(TrainerCallback):
    def __init__(
        self,
        run_dir: Path,
        planned_bytes: int | None = None,
        budget_bytes: int | None = None,
        probe_bytes: int | None = None,
    ):
        self.run_dir = run_dir
        self.planned_bytes, self.budget_bytes, self.probe_bytes = planned_bytes, budget_bytes, probe_bytes
        self.steps: list[dict] = []
        self.logged = 0  # steps already summed into a tracker line

    def tracker_figures(self) -> dict[str, float]:
        """What each training log line carries to the trackers (train.report_to), in GiB: the measured peak of
        the steps since the previous line (what `peak_kind` says: the whole GPU process, or the CPU resident set),
        beside the plan's predicted peak, the probe's measured peak and the card's budget, so every tracker
        draws the margin the console only states once."""
        recent, self.logged = self.steps[self.logged :], len(self.steps)
        figures = {}
        if recent:
            key = _peak_key(recent[0])
            figures["memory/step_peak_gib"] = max(s[key] for s in recent) / GIB
        for key, value in (
            ("memory/planned_peak_gib", self.planned_bytes),
            ("memory/probe_peak_gib", self.probe_bytes),
            ("memory/budget_gib", self.budget_bytes),
        ):
            if value:
                figures[key] = value / GIB
        return figures

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, **_sample()})

    def peak(self) -> dict:
        """The run's one measured peak for the closing line, named by what it measures: on a GPU the whole
        process (peak reserve + context and kernels outside the allocator), the figure the plan's estimated
        peak predicts; on CPU the process's resident set, which the plan's tensor bytes do not predict."""
        if not self.steps:
            return {}
        key = _peak_key(self.steps[0])
        return {
            "measured_peak_bytes": max(s[key] for s in self.steps),
            "peak_kind": "GPU, whole process, as planned" if key == "peak_process" else "process RSS, not planned",
        }  # the plan counts tensors only

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.steps:
            save_timeline(self.steps, self.run_dir, self.planned_bytes, self.budget_bytes)


def save_timeline(
    steps: list[dict], run_dir: Path, planned_bytes: int | None = None, budget_bytes: int | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    write_text(
        run_dir / "memory_timeline.json",
        json.dumps({"planned_bytes": planned_bytes, "budget_bytes": budget_bytes, "steps": steps}) + "\n",
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [s["step"] for s in steps]
    for key in (k for k in steps[0] if k != "step"):
        ax.plot(x, [s[key] / GIB for s in steps], label=key.replace("_", " "), marker=".")
    on_gpu = "reserved" in steps[0]
    if on_gpu and planned_bytes:  # the plan's whole-process prediction; on CPU it is not comparable to RSS
        ax.axhline(planned_bytes / GIB, color="tab:purple", linestyle="--", label="planned peak")
    if on_gpu and budget_bytes:
        ax.axhline(budget_bytes / GIB, color="tab:red", linestyle=":", label="budget")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory per step" if on_gpu else "CPU: peak resident set per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    path = run_dir / "memory_timeline.png"
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_bytes(path, buffer.getvalue())
    plt.close(fig)
    return path
