"""Honest CPU measurement of live tensor bytes: what the estimator's tensor terms are checked against.

`LiveTensorTracker` is a `TorchDispatchMode`: every tensor an op returns (forward, backward and
optimizer ops alike: autograd runs backward ops through the dispatcher with this mode active) has its
*untyped storage* registered once, keyed by the storage's address, with its size in bytes. A weakref
callback on the storage object fires when the storage is freed and subtracts it again. Views share a
storage and are counted once; in-place ops return an existing storage and add nothing.

Baseline: tensors that exist before entry (weights, optimizer states, the batch) are invisible to a
dispatch mode until an op returns them. Pass them as `baseline=` (any iterable of tensors, e.g.
`[*model.parameters(), *model.buffers(), *optimizer state tensors]`): their distinct storages are
counted in `baseline_bytes` and in `current_bytes`/`peak_bytes` for as long as they live. Without a
baseline, the numbers are bytes allocated inside the block only.

No allocator rounding: these are tensor bytes, what CUDA's `memory_allocated` would show before its
512-byte rounding. CUDA context, workspaces and caching slack are the estimator's separate terms.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    def __init__(self, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, int] = {}  # storage key -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        for t in baseline:
            self._register(t)
        self.baseline_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes

    @property
    def peak_new_bytes(self) -> int:
        """Peak minus what was alive at entry."""
        return self.peak_bytes - self.baseline_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def _register(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0 or key == 0:
            return
        old = self._live.get(key)
        if old is not None and self._refs[key]() is not None:
            if nbytes != old:  # resized in place (out= ops, resize_)
                self.current_bytes += nbytes - old
                self._live[key] = nbytes
        else:
            self._live[key] = nbytes
            self.current_bytes += nbytes
            self._refs[key] = weakref.ref(st, self._freed_callback(key))
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _freed_callback(self, key: int):
        def freed(ref: weakref.ref) -> None:
            # A new storage may already sit at the same address; only drop the entry this ref owns.
            if self._refs.get(key) is ref:
                self.current_bytes -= self._live.pop(key)
                del self._refs[key]
        return freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._register(t)
        return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_lora_step(arch, shape, seed: int = 0) -> tuple[int, int]:
    """Peak live tensor bytes (incl. weights, adapters, Adam states, batch) of one steady-state LoRA step on
    CPU, built as glmtune/train/trainer.py's build_model does. Adam states are created untracked; the step
    after is measured. Returns (peak_bytes, baseline_bytes). `arch` is a GLMConfig, `shape` a memory.RunShape."""
    from ..config import LoraConfig
    from ..train.lora import apply_lora, trainable_parameters
    from ..train.optim import make_optimizer
    from ..plan.estimate import BYTES
    from ..models import ChatGLMForConditionalGeneration, enable_checkpointing

    dtype = {2: torch.bfloat16, 4: torch.float32}[BYTES[shape.dtype]]
    torch.manual_seed(seed)
    model = ChatGLMForConditionalGeneration(arch).to(dtype)
    model.config.use_cache = False
    model.loss_chunk_tokens = shape.loss_chunk_tokens
    model = apply_lora(model, LoraConfig(r=shape.lora_r, alpha=2 * shape.lora_r, dropout=shape.lora_dropout,
                                         target_modules=list(shape.lora_targets), use_dora=shape.use_dora))
    if shape.gradient_checkpointing:
        enable_checkpointing(model, use_reentrant=True)
        model.enable_input_require_grads()
    model.train()
    params = trainable_parameters(model)
    opt = make_optimizer(shape.optimizer, params, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, arch.padded_vocab_size, (shape.micro_batch, shape.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}

    # shape.autocast: bf16 autocast as the Trainer runs mixed precision (on CPU too, with train.precision=bf16).
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.autocast)

    def step() -> None:
        with amp:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Adam's states, as a first step leaves them, without that step's forward and backward (the model holds no
    # caches a forward would fill): a bf16 matmul is ~50x slower than fp32 on CPUs without AVX-512 BF16.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    baseline = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), *batch.values()]
    with LiveTensorTracker(baseline) as tracker:
        step()
    return tracker.peak_bytes, tracker.baseline_bytes
