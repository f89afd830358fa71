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

from ..atomic import write_bytes, write_text
from .gpumem import outside_allocator_bytes

GIB = 2**30


def _sample() -> dict[str, float]:
    if torch.cuda.is_available():
        sample = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                  "peak_allocated": torch.cuda.max_memory_allocated(),
                  "peak_reserved": torch.cuda.max_memory_reserved()}
        sample["peak_process"] = sample["peak_reserved"] + outside_allocator_bytes()
        torch.cuda.reset_peak_memory_stats()  # so each step's peak is its own
        return sample
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class MemoryTimeline(TrainerCallback):
    def __init__(self, run_dir: Path, planned_bytes: int | None = None, budget_bytes: int | None = None):
        self.run_dir = run_dir
        self.planned_bytes, self.budget_bytes = planned_bytes, budget_bytes
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, **_sample()})

    def peak(self) -> dict:
        """The run's measured peak for the summary: reserved bytes on a GPU, the process's resident set on CPU."""
        key = "peak_reserved" if self.steps and "peak_reserved" in self.steps[0] else "peak_rss"
        if not self.steps:
            return {}
        return {"measured_peak_bytes": max(s[key] for s in self.steps),
                "peak_kind": "GPU reserved" if key == "peak_reserved" else "CPU resident set"}

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.steps:
            save_timeline(self.steps, self.run_dir, self.planned_bytes, self.budget_bytes)


def save_timeline(steps: list[dict], run_dir: Path, planned_bytes: int | None = None,
                  budget_bytes: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    write_text(run_dir / "memory_timeline.json",
               json.dumps({"planned_bytes": planned_bytes, "budget_bytes": budget_bytes, "steps": steps}) + "\n")
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
