"""What a GPU process really holds: the allocator's reserve plus what lies outside it (context, kernels, NCCL).

The estimator predicts the whole process (plan/estimate.py adds the CUDA context, workspaces, NCCL and the
allocator's reserve to the tensor peak), so the probe must measure the whole process too: torch's
`max_memory_reserved` alone misses the ~0.75 GiB of context a card must also hold. NVML's per-process
figure is the truth; where NVML cannot name this process (some containers hide pids), the device's used
memory minus what was used before this process is the fallback.
"""

from __future__ import annotations

import os

import torch


def _nvml():
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def _nvml_index(device: int) -> int:
    """NVML numbers all GPUs; torch numbers the visible ones."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return int(ids[device]) if ids and ids[device].isdigit() else device


def process_bytes(device: int | None = None) -> int | None:
    """Device memory this process holds on `device` (current device by default), from NVML; None when NVML
    has no figure for this process."""
    nvml = _nvml()
    if nvml is None or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device() if device is None else device
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
    except nvml.NVMLError:
        return None
    return None


def outside_allocator_bytes() -> int:
    """Bytes this process holds beyond torch's current reserve: CUDA context, loaded kernel modules, NCCL.
    Read after some real work, so the lazily loaded kernels are in. Falls back to the device's used memory
    minus the reserve (exact when this process is alone on the GPU)."""
    reserved = torch.cuda.memory_reserved()
    held = process_bytes()
    if held is None:
        free, total = torch.cuda.mem_get_info()
        held = total - free
    return max(0, held - reserved)
