"""Failures of the full run, explained: what happened, the memory breakdown, and the override to type.

| kind                  | recognised by                                          | exit |
|-----------------------|--------------------------------------------------------|------|
| oom                   | torch.cuda.OutOfMemoryError / "CUDA out of memory"    | 4    |
| nvml_oom              | nvmlDeviceGetNvLinkRemoteDeviceType INTERNAL ASSERT    | 4    |
| nccl                  | NCCL errors, DistBackendError, collective timeouts     | 5    |
| transformers_version  | remote code's standardize_cache_format / padding_side  | 6    |

The NVML assert is what torch >= 2.3 raises on drivers whose libnvidia-ml lacks that symbol while it
handles an out-of-memory (GLM-4 issue #275: the official GLM-4V script on 4x A100-40G): it is an OOM.
On an OOM a snapshot of the allocator history is written for https://pytorch.org/memory_viz. Checkpoints
already saved by the Trainer are complete files and are left untouched.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config.units import GIB
from ..launch.exits import EXIT_NCCL, EXIT_OOM, EXIT_TRANSFORMERS

EXIT = {"oom": EXIT_OOM, "nvml_oom": EXIT_OOM, "nccl": EXIT_NCCL, "transformers_version": EXIT_TRANSFORMERS}

EXPLAIN = {
    "oom": "CUDA ran out of memory during training: the run needs more than the card has at some step "
    "(a longer batch than the probe saw, evaluation, or fragmentation).",
    "nvml_oom": "this NVML 'INTERNAL ASSERT FAILED' is an out-of-memory in disguise: torch >= 2.3 on a driver "
    "whose libnvidia-ml lacks nvmlDeviceGetNvLinkRemoteDeviceType fails this way while handling "
    "an OOM (GLM-4 issue #275). Treat it as an OOM; upgrading the NVIDIA driver restores the real message.",
    "nccl": "a collective operation failed between ranks: usually one rank died first (look for an OOM in "
    "its rank*.log) or the ranks cannot reach each other (network interface, firewall, timeout).",
    "transformers_version": "the checkpoint's own Python code (trust_remote_code) was written for another "
    "transformers version than 4.40.2; glmtune's native model does not use it.",
}


def classify(err: BaseException) -> str | None:
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in text:
        return "oom"
    if "nvmlDeviceGetNvLinkRemoteDeviceType" in text or ("INTERNAL ASSERT FAILED" in text and "driver_api" in text):
        return "nvml_oom"
    if "NCCL" in text or type(err).__name__ == "DistBackendError" or "Watchdog caught collective" in text:
        return "nccl"
    if "standardize_cache_format" in text or "'padding_side'" in text:
        return "transformers_version"
    return None


def advice(kind: str, choices: dict, probe_enabled: bool) -> list[str]:
    """Concrete overrides, most likely to help first."""
    if kind in ("oom", "nvml_oom"):
        out = [] if probe_enabled else ["probe.enabled=true  (measure the worst batch before training)"]
        if choices.get("micro_batch_size", 1) > 1:
            mb, acc = choices["micro_batch_size"], choices["grad_accum"]
            out.append(f"train.per_device_batch_size={mb // 2} train.grad_accum={acc * 2}  (same global batch)")
        if not choices.get("gradient_checkpointing", True):
            out.append("train.gradient_checkpointing=on")
        out.append("hw.margin=0.8  (plan with more headroom: the planner then picks the next memory lever)")
        if choices.get("zero_stage", 0) == 0:
            out.append("dist=zero3 with more GPUs: scripts/torchrun.sh 2 dist=zero3 ...")
        out.append(f"data.max_length={max(64, choices.get('max_length', 500) // 2)}")
        return out
    if kind == "nccl":
        return ["NCCL_DEBUG=INFO (and NCCL_SOCKET_IFNAME=<interface>) before torchrun, then read every rank*.log"]
    return ["model.trust_remote_code=false  (glmtune's own GLM-4 implementation)"]


def _write_snapshot(run_dir: Path) -> Path | None:
    if not torch.cuda.is_available():
        return None
    path = run_dir / "oom_snapshot.pickle"
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception:  # noqa: BLE001 - a failed snapshot must not hide the diagnosis
        return None
    return path


def record_memory_history() -> None:
    """Keep the allocator's recent history so an OOM can be dumped for memory_viz (CUDA only)."""
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=100_000)


@contextmanager
def diagnosed(run_dir: Path, breakdown: dict[str, int], choices: dict, probe_enabled: bool):
    """Turn a recognised failure into its explanation and exit code; anything else propagates unchanged."""
    try:
        yield
    except Exception as err:  # noqa: BLE001
        kind = classify(err)
        if kind is None:
            raise
        lines = [f"glmtune: {kind}: {EXPLAIN[kind]}", f"  error: {str(err).splitlines()[0][:300]}"]
        if kind in ("oom", "nvml_oom"):
            snapshot = _write_snapshot(run_dir)
            lines.append("  planned memory (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in breakdown.items()))
            if snapshot:
                lines.append(f"  allocator snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)")
        lines += [f"  try: {a}" for a in advice(kind, choices, probe_enabled)]
        print("\n".join(lines), file=sys.stderr)
        sys.exit(EXIT[kind])
