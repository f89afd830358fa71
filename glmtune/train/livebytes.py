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
