"""The resume check's weight fingerprint (glmtune/rundir/fingerprint.py) on checkpoint-sized files, warm and cold.

    python bench/fingerprint_speed.py                    # 18 GB sparse file + 2 GB of real bytes, in a temp folder
    python bench/fingerprint_speed.py --dir /models/x    # also every *.safetensors of a real checkpoint folder
    python bench/fingerprint_speed.py --real-gb 0.5      # a smaller real file (disk space, time)

Rows:
- sparse: an 18 GB file made with truncate plus random 1 MiB blocks every 256 MiB and a safetensors-like header;
  its holes read as zeros without disk I/O, so it measures the hashing and the system calls, not the disk.
- real: a file of random bytes (the size of one GLM-4-9B shard, ~2 GB, by default) evicted from the page cache
  with POSIX_FADV_DONTNEED before the cold run, so the cold time includes the disk's random reads.
- full sha256 of the real file (up to 4 GB), the cost the sampled fingerprint avoids.
- size+mtime (os.stat), what the check cost before.
A checkpoint of N shard files costs N times the per-file time (the fingerprint reads about 4 KiB per MiB up to 16
MiB per file, and the small tensors whole).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from glmtune.rundir.fingerprint import block_offsets, weight_fingerprint  # noqa: E402

GB = 10**9


def header_bytes(size: int) -> bytes:
    """A safetensors header describing one big bf16 tensor that fills the file after it."""
    body = {"__metadata__": {"format": "pt"}}
    header = json.dumps({**body, "w": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 0]}}).encode()
    data = size - 8 - len(header) - 64
    header = json.dumps({**body, "w": {"dtype": "BF16", "shape": [data // 2], "data_offsets": [0, data]}}).encode()
    header += b" " * (size - 8 - len(header) - data)
    return struct.pack("<Q", len(header)) + header


def make_sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(header_bytes(size))
        for offset in range(256 << 20, size - (1 << 20), 256 << 20):
            f.seek(offset)
            f.write(os.urandom(1 << 20))


def make_real(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(header_bytes(size))
        left = size - f.tell()
        chunk = os.urandom(64 << 20)
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def full_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def row(name: str, size: int, what: str, seconds: float) -> None:
    print(f"| {name} | {size / GB:.1f} | {what} | {seconds * 1000:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparse-gb", type=float, default=18.0)
    parser.add_argument("--real-gb", type=float, default=2.0)
    parser.add_argument("--dir", type=Path, help="a checkpoint folder: fingerprint its *.safetensors too")
    parser.add_argument("--tmp", type=Path, default=None, help="where to write the files (default: a temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        print("| file | GB | what | ms |\n|---|---|---|---|")
        sparse, real = Path(folder) / "sparse.safetensors", Path(folder) / "real.safetensors"
        size = int(args.sparse_gb * GB)
        make_sparse(sparse, size)
        row(
            "sparse",
            size,
            f"fingerprint, warm ({len(block_offsets(size))} blocks), best of 5",
            timed(lambda: weight_fingerprint(sparse), 5),
        )
        row("sparse", size, "size+mtime (os.stat), best of 5", timed(lambda: os.stat(sparse), 5))
        sparse.unlink()
        if args.real_gb > 0:
            size = int(args.real_gb * GB)
            make_real(real, size)
            evict(real)
            row(
                "real",
                size,
                f"fingerprint, cold ({len(block_offsets(size))} blocks)",
                timed(lambda: weight_fingerprint(real)),
            )
            row("real", size, "fingerprint, warm, best of 5", timed(lambda: weight_fingerprint(real), 5))
            if size <= 4 * GB:  # ~4.5 s per GB here: the point is made on one shard
                evict(real)
                row("real", size, "full sha256, cold", timed(lambda: full_sha256(real)))
        for file in sorted(args.dir.glob("*.safetensors")) if args.dir else []:
            evict(file)
            size = file.stat().st_size
            row(file.name, size, "fingerprint, cold", timed(lambda: weight_fingerprint(file)))
            row(file.name, size, "fingerprint, warm", timed(lambda: weight_fingerprint(file)))


if __name__ == "__main__":
    main()
