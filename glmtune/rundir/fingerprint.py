"""A weight file's content fingerprint for resume checks: cheap on an 18 GB checkpoint, and sure to see any edit
that rewrites a tensor.

Hashing every byte would cost minutes per launch (sha256 runs at ~1 GB/s per core, and the files are read cold),
size and mtime alone miss an edit in place whose mtime was restored. What is hashed instead, with the size:

- the safetensors header whole (tensor names, dtypes, shapes and byte offsets: any change of layout);
- every tensor of at most SMALL_TENSOR bytes whole (norm weights and biases, ~1 MB in all for GLM-4-9B),
  up to SMALL_TOTAL bytes per file;
- BLOCK-byte blocks at fixed offsets spread evenly over the whole file, one per MiB of file (at least 64,
  at most 4096), so the gap between two sampled blocks is at most max(1 MiB, size / 4096).

So a changed run of bytes longer than that gap (any rewritten tensor of more than ~1 MiB: a LoRA merge into
query_key_value, a fine-tune, a re-quantization) always reaches a sampled block, and an edit to the header or to
a small tensor is always seen. A few changed bytes inside a large tensor are seen only when they fall in a
sampled block (about 0.4 % of the file): not a defence against a deliberate edit that avoids the fixed offsets.
A .bin (pickle) file has no header to parse: its first MiB and the blocks are hashed.

Reads go through os.pread with POSIX_FADV_RANDOM (no readahead of the gaps), every block's read queued first
with POSIX_FADV_WILLNEED so a cold disk serves them in parallel; bench/fingerprint_speed.py measures it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from ..config.units import MIB

BLOCK = 4096  # bytes per sampled block: one page, one read
MIN_BLOCKS, MAX_BLOCKS = 64, 4096
SMALL_TENSOR = MIB  # tensors up to 1 MiB are hashed whole: norms and biases, which sampling would miss
SMALL_TOTAL = 64 * MIB  # at most this many bytes of small tensors per file
HEADER_LIMIT = 100 * MIB  # safetensors' own limit on the header's size
LEGACY = "bytes, modified"  # the size-and-mtime form run_state.json held before this module


def block_offsets(size: int) -> list[int]:
    """Where the sampled blocks start: evenly spread from the first byte to the last block of the file."""
    if size <= BLOCK:
        return [0]
    count = min(MAX_BLOCKS, max(MIN_BLOCKS, size >> 20))
    last = size - BLOCK
    return sorted({i * last // (count - 1) for i in range(count)})


def _safetensors_layout(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """(the header bytes, the byte spans of the small tensors) or None when `fd` is not a safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head)
    if not 2 <= length <= min(HEADER_LIMIT, size - 8):
        return None
    header = os.pread(fd, length, 8)
    try:
        entries = json.loads(header)
        spans = [tuple(v["data_offsets"]) for k, v in entries.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    start = 8 + length
    small, total = [], 0
    for begin, end in sorted(s for s in spans if isinstance(s[0], int) and isinstance(s[1], int)):
        if 0 < end - begin <= SMALL_TENSOR and total + (end - begin) <= SMALL_TOTAL:
            small.append((start + begin, end - begin))
            total += end - begin
    return header, small


def weight_fingerprint(path: str | os.PathLike) -> str:
    """'<size> bytes, sampled sha256 <hex>' of the file's content as described above."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        layout = _safetensors_layout(fd, size)
        if layout is None:
            digest.update(b"raw\0" + os.pread(fd, MIB, 0))
        else:
            header, small = layout
            digest.update(b"safetensors\0" + header)
            for offset, length in small:
                digest.update(os.pread(fd, length, offset))
        offsets = block_offsets(size)
        if hasattr(os, "posix_fadvise"):  # queue every block's read at once: the disk serves them in parallel
            for offset in offsets:
                os.posix_fadvise(fd, offset, BLOCK, os.POSIX_FADV_WILLNEED)
        for offset in offsets:
            digest.update(os.pread(fd, BLOCK, offset))
    finally:
        os.close(fd)
    return f"{size} bytes, sampled sha256 {digest.hexdigest()[:32]}"


def legacy_fingerprint(path: str | os.PathLike) -> str:
    """The size-and-mtime form, to compare with a run recorded before content fingerprints."""
    stat = Path(path).stat()
    return f"{stat.st_size} {LEGACY} {stat.st_mtime_ns}"
