"""Third-party notices that carry no action for someone running glmtune, silenced where they start.

The console is glmtune's (README "What a run does"): its header, tables, step lines and one closing line.
Anything else a library prints there is either an error (kept) or one of the notices below, each measured on a
2-rank CPU ZeRO-3 torchrun launch, where they were 40 of the console's lines. What is silenced here still
reaches nobody: it is a deprecation inside a library, or a fact the header already states.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import warnings


def quiet_libraries() -> None:
    """Before DeepSpeed is imported (it reads DS_ACCELERATOR then)."""
    import torch

    # DeepSpeed warns at import, on every rank, that it fell back to its CPU accelerator; the header says where
    # the run is. Naming the accelerator DeepSpeed would pick anyway is how it is told: cpu, when its own
    # detection finds nothing else (CUDA, XPU, MPS, or one of the vendor packages it tries to import).
    if "DS_ACCELERATOR" not in os.environ and not _other_accelerator(torch):
        os.environ["DS_ACCELERATOR"] = "cpu"
    # torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor, which DeepSpeed's ZeRO-3 calls
    # on every step: two FutureWarnings per call site and rank, about code that is not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
    # accelerate and peft import transformers.deepspeed, deprecated for transformers.integrations in 4.40.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.deepspeed")
    # transformers 4.40's Trainer enters torch.cpu.amp.autocast (deprecated in torch 2.4) for bf16 on CPU (+hw=
    # presets): once per training and once per evaluation; nothing the user can change.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.cpu\.amp\.autocast")
    # bitsandbytes 0.50 on a CPU with AVX512-BF16 (most GPU hosts) tries the optional `kernels` package at import
    # and warns when it is absent: an optional CPU kernel, not used by a GPU run. Kept in rank<N>.log as INFO.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(ToInfo("Failed to load CPU gemm_4bit_forward"))


class ToInfo(logging.Filter):
    """Lowers a logger's records that start with `prefix` to INFO: below the console, still in the rank logs."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(self.prefix):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


# The packages DeepSpeed 0.19's get_accelerator() imports to detect NPU, SDAA, HPU, MLU, SUPA and KLXPU devices.
_VENDOR_PACKAGES = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")


def _other_accelerator(torch) -> bool:
    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return True
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return True
    return any(importlib.util.find_spec(name) is not None for name in _VENDOR_PACKAGES)


@contextlib.contextmanager
def prints_to_log(name: str):
    """Lines a library print()s inside the block go to this rank's log (INFO) instead of the console: DeepSpeed
    prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" on every rank when its
    first engine sets up the CPU shared-memory collectives."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                logging.getLogger(name).info("%s", line)
