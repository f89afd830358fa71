"""Memory per optimizer step, saved with every run as memory_timeline.png (+ .json with the numbers).

On a GPU: allocated and reserved bytes (torch.cuda.memory_allocated / memory_reserved) and their peaks
since the previous step. On CPU there is no caching allocator to read, so the process's resident set
size stands in; the plot says which it shows.
"""
from __future__ import annotations

import io
import json
import resource
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..atomic import write_bytes, write_text

GIB = 2**30


def _sample() -> dict[str, float]:
    if torch.cuda.is_available():
        sample = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                  "peak_allocated": torch.cuda.max_memory_allocated(),
                  "peak_reserved": torch.cuda.max_memory_reserved()}
        torch.cuda.reset_peak_memory_stats()  # so each step's peak is its own
        return sample
    # ru_maxrss is in KiB on Linux: the peak resident set of this process so far.
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class MemoryTimeline(TrainerCallback):
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, **_sample()})

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.steps:
            save_timeline(self.steps, self.run_dir)


def save_timeline(steps: list[dict], run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    write_text(run_dir / "memory_timeline.json", json.dumps(steps) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [s["step"] for s in steps]
    for key in (k for k in steps[0] if k != "step"):
        ax.plot(x, [s[key] / GIB for s in steps], label=key.replace("_", " "), marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory per step" if "reserved" in steps[0] else "CPU: peak resident set per step")
    ax.grid(alpha=0.3)
    ax.legend()
    path = run_dir / "memory_timeline.png"
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_bytes(path, buffer.getvalue())
    plt.close(fig)
    return path
