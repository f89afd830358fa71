"""The process group of a rehearsal (probe/rehearse.py): this process is rank 0 of N, and no collective moves data.

Like torch's fake process group (torch.testing._internal.distributed.fake_pg, whose FakeStore a rehearsal still
initialises with), every collective of `RehearsalGroup` returns at once and fills its outputs with this rank's own
input: an all-gather repeats it N times, an all-to-all hands it back, a reduce-scatter keeps this rank's chunk, an
all-reduce leaves it. Shapes are real and values finite (nothing turns NaN from an empty buffer), and the outputs
are the caller's tensors, allocated as for a real collective, so the memory the probe measures is rank 0's.
torch's own fake group could not be used as it is: its work objects carry no result (torch 2.13), and DDP's
reducer asserts on that at the first backward ("expected the hook result is either a Tensor or a TensorList").

One collective's values decide the program, so they are the real ones here: the row layout a sequence-parallel
rank gathers before attention (models/kernels/ulysses.gather_sequence: the seq ids of packed rows, the padding mask).
Per-document attention reads the documents' spans from the gathered seq ids, and refuses a document in two
pieces, which rank 0's shard repeated N times would be (0 0 1 1 | 0 0 1 1); the padding mask decides whether a
mask is built at all (models/kernels/masks.py). Every rank of a group gets the same micro-batch and rank 0 holds each row
whole before cutting it, so the rows models/kernels/ulysses.pad_and_shard cuts are offered to the group first
(`remember`: integer rows only, by weak reference, so nothing stays alive for it), and an all-gather of this
rank's shard of a remembered row returns that row's shards, as the real ranks would send them: exact, not a guess.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "rehearsal"


def _done(result) -> dist.Work:
    """A finished collective's work. A future holding CUDA tensors must name their devices (torch checks it when
    the value is set, and records an event on each device's stream for whoever waits on it: DDP's reducer)."""
    tensors = [
        t
        for t in (result if isinstance(result, list) else [result])
        for t in (t if isinstance(t, list) else [t])
        if isinstance(t, torch.Tensor)
    ]
    future = Future(devices=sorted({t.device for t in tensors if t.is_cuda}, key=str) or None)
    future.set_result(result)
    return _create_work_from_future(future)


class RehearsalGroup(dist.ProcessGroup):
    """Rank `rank` of `size` (a rehearsal's world, and every group made in it); collectives complete at once."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._rows: deque[weakref.ref] = deque(maxlen=16)  # the rows cut lately (a micro-step cuts 2-5)

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    def remember(self, row: torch.Tensor) -> None:
        """A whole (padded) row [B, S] that models/kernels/ulysses.pad_and_shard is about to cut over this group."""
        if not row.is_floating_point() and row.dim() == 2:
            self._rows.append(weakref.ref(row))

    def _shards(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """What each rank of the group sends for this rank's `shard`: a remembered row's shards, else the shard."""
        for ref in reversed(self._rows):
            row = ref()
            if (
                row is not None
                and shard.dim() == 2
                and row.dtype == shard.dtype
                and row.shape[0] == shard.shape[0]
                and row.shape[1] == shard.shape[1] * self._size
            ):
                parts = row.to(shard.device).chunk(self._size, dim=1)
                if torch.equal(parts[self._rank], shard):
                    return list(parts)
        return [shard] * self._size

    # Gathers and exchanges -----------------------------------------------------------------------------------
    def allgather(self, outputs, inputs, opts=None):
        for outs, shard in zip(outputs, inputs):
            for out, part in zip(outs, self._shards(shard)):
                out.copy_(part)
        return _done(outputs)

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self.allgather(outputs, inputs, opts)

    def all_gather_single(self, output, input, opts=None):  # all_gather_into_tensor
        for out in output.chunk(self._size):
            out.copy_(input.reshape(out.shape))
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input)
        return _done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        output.copy_(input.reshape(output.shape))
        return _done([output])

    def alltoall(self, outputs, inputs, opts=None):
        for out, part in zip(outputs, inputs):
            out.copy_(part)
        return _done(outputs)

    def gather(self, outputs, inputs, opts=None):
        for outs, shard in zip(outputs, inputs):
            for out in outs:
                out.copy_(shard)
        return _done(outputs)

    def scatter(self, outputs, inputs, opts=None):
        for out, parts in zip(outputs, inputs):
            if parts:
                out.copy_(parts[self._rank])
        return _done(outputs)

    # Reductions: this rank's value stands for the result (finite; the probe stops on memory, not on a value) -----
    def allreduce(self, tensors, opts=None):
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def reduce_scatter(self, outputs, inputs, opts=None):
        for out, parts in zip(outputs, inputs):
            out.copy_(parts[self._rank])
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):  # reduce_scatter_tensor
        output.copy_(input.chunk(self._size)[self._rank].reshape(output.shape))
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input)
        return _done(outputs)

    def barrier(self, opts=None):
        return _done(None)

    # torch < 2.13 calls the same collectives by their older names (distributed_c10d.py: group.alltoall_base,
    # group._allgather_base, ...); without these the base class's C++ method runs and asks for a backend per device
    # ("No backend type associated with device type cuda": torch 2.11 on the H200, bench/RESULTS.md §24).
    alltoall_base = all_to_all_single
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def _create(prefix_store, rank: int, world_size: int, timeout) -> RehearsalGroup:
    return RehearsalGroup(rank, world_size)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
