"""`train.compile=auto|on|off`: torch.compile of each decoder block, for fewer kernel launches.

Short examples leave a GPU launch-bound: the 9B model at 512 tokens per step launches ~6,500 kernels and
keeps the GPU busy 57 ms of a ~190 ms step (measured on an H100). Compiling each block (not the whole model) lets
inductor fuse the element-wise chains that dominate the launch count — RMSNorm's fp32 variance, the
rotary rotation, SwiGLU's silu(gate) * up, the LoRA path's dropout/scale/add — while the model code stays
plain PyTorch, the HF Trainer still drives the step, and gradient checkpointing still wraps whole
blocks (the compiled block runs inside the checkpoint). All 40 blocks share one code object, so one
compilation serves every layer.

auto: on only where a GPU row of bench/RESULTS.md has measured compiled blocks (tokens/s, and the peak
against the estimate, which has no term for them): MEASURED_COMPILE below. No such row exists yet (the
blocks were merged after the H100 calibration), so auto is off everywhere until `bench/gpu_pending.py
--part 3` has run on a card and its row is added. Always off on CPU: the first step's compile costs tens of
seconds to minutes, more than a CPU run saves. Off under ZeRO-3: its per-module parameter gather/release
hooks break the graphs, and DeepSpeed has its own compile path. `train.compile=on` works anywhere; the
probe then runs the compiled blocks, and their memory is the probe's measurement, not the estimate's.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, TrainConfig
from ..models.kernels.attnpath import DENSE_MASK_MAX

# GPUs (a substring of torch.cuda.get_device_name()) on which a bench/RESULTS.md row measured compiled blocks
# without ZeRO-3 (speed-up and peak against the estimate), and those on which it measured FlexAttention for
# packed rows with them. Add a name only with its row. Empty: nothing has been measured on a GPU yet.
MEASURED_COMPILE: tuple[str, ...] = ()
MEASURED_FLEX: tuple[str, ...] = ()
BY_LENGTH = (
    f"a dense block-diagonal mask (sdpa) for rows up to {DENSE_MASK_MAX} positions, per-document SDPA "
    f"(segments) above: no [S, S] tensor"
)
UNMEASURED = "no GPU row in bench/RESULTS.md has measured it yet (bench/gpu_pending.py --part 3)"


def _measured_here(names: tuple[str, ...]) -> str | None:
    """The measured GPU name that this process's CUDA device matches, if any."""
    device = torch.cuda.get_device_name(0)
    return next((name for name in names if name in device), None)


def resolve_compile(cfg: TrainConfig, zero_stage: int) -> tuple[bool, str]:
    """(compile the blocks?, why)."""
    if cfg.compile != "auto":
        why = f"train.compile={cfg.compile}"
        return cfg.compile == "on", why + (
            "; its memory is the probe's measurement, not the estimate's (the "
            "estimator has no term for compiled blocks)"
            if cfg.compile == "on"
            else ""
        )
    if not torch.cuda.is_available():
        return False, "auto: off on CPU (compile time exceeds what a CPU run saves)"
    if zero_stage == 3:
        return False, "auto: off under ZeRO-3 (its parameter hooks break the compiled graphs)"
    measured = _measured_here(MEASURED_COMPILE)
    if measured is None:
        return False, f"auto: off: {UNMEASURED} for {torch.cuda.get_device_name(0)}; train.compile=on to try it"
    return True, f"auto: on (measured on {measured}, no ZeRO-3): fused element-wise kernels, fewer launches"


def check_attention(cfg: TrainConfig) -> None:
    """Before any weights load: a forced FlexAttention needs CUDA (torch has no FlexAttention backward on CPU)."""
    if cfg.packed_attention == "flex" and not torch.cuda.is_available():
        raise ConfigError(
            "train.packed_attention=flex needs a CUDA device (FlexAttention has no backward on CPU) "
            "— use train.packed_attention=auto or sdpa"
        )


def resolve_packed_attention(cfg: TrainConfig, compiled: bool, attention_dropout: float) -> tuple[str, str]:
    """Attention of packed rows (data/packing.py), (name, why).

    sdpa: a dense [B, 1, S, S] boolean block-diagonal causal mask (S^2 bytes per row: 64 MiB at 8K); runs
    everywhere, but the masked kernel computes every block of the row. segments: causal SDPA per document
    (models/kernels/docattention.py), no [S, S] tensor; a row of k examples costs ~1/k of the attention, in k kernel calls.
    flex: FlexAttention with a block mask skips the blocks between examples, but is only fast compiled, has no
    CPU backward and no dropout. auto without flex: the model picks sdpa or segments by each row's length."""
    if cfg.packed_attention != "auto":
        return cfg.packed_attention, f"train.packed_attention={cfg.packed_attention}"
    if torch.cuda.is_available() and compiled and attention_dropout == 0:
        measured = _measured_here(MEASURED_FLEX)
        if measured is not None:
            return "flex", f"auto: flex (measured on {measured}, compiled blocks): blocks between examples are skipped"
        return "auto", f"auto: {BY_LENGTH}; FlexAttention {UNMEASURED}; train.packed_attention=flex to try it"
    return "auto", f"auto: {BY_LENGTH} (flex needs CUDA and compiled blocks)"


def describe(cfg: TrainConfig, zero_stage: int, attention_dropout: float, packed: bool) -> str:
    """One console line: what the run compiles and how packed rows attend."""
    compiled, why = resolve_compile(cfg, zero_stage)
    line = f"compile: {'on' if compiled else 'off'} — {why}"
    if packed:
        name, why_attention = resolve_packed_attention(cfg, compiled, attention_dropout)
        line += f"; packed attention: {name} — {why_attention}"
    return line


def set_packed_attention(model: torch.nn.Module, name: str) -> None:
    for module in model.modules():
        if hasattr(module, "packed_attention"):
            module.packed_attention = name


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder block in place (nn.Module.compile keeps names, hooks and state_dict keys);
    returns how many. Matched by class name so remote-code models (trust_remote_code) are covered too.
    dynamic=None: the first shape compiles static, a second shape recompiles once with symbolic lengths."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in ("GLMBlock", "Glm4DecoderLayer"):  # ChatGLM's block, GLM-4-0414's
            module.compile(backend=backend)
            count += 1
    return count
