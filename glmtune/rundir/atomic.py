"""Durable file writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

Every file a run leaves is written to a temporary name in the same folder, flushed and fsynced, then
renamed over the final name (rename within one filesystem is atomic on POSIX), and the folder is
fsynced so the rename itself survives a power cut. A write that fails (full disk, quota) removes its
temporary file and leaves the old file untouched. A folder written as one unit (the adapter: its
weights and its adapter_config.json) is built under a temporary name and renamed into place whole.

Imports nothing from glmtune, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..config.units import MIB

# Errors that mean "the disk cannot take this write", reported as one line instead of a traceback.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# torch.save and safetensors report a failed write as RuntimeError / SafetensorError with the OS text inside.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "File too large", "file write failed")
# torch.save's zip writer (caffe2 inline_container.cc) names no errno: a short fwrite is "unexpected pos N vs M".
# On a local or network disk a short write is ENOSPC, EDQUOT or EFBIG, so it counts as full even when the failed
# file's removal has freed space again by the time the crash is reported (disk_nearly_full then misses it).
_SHORT_WRITE_TEXT = ("inline_container", "unexpected pos")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create 0600/0700 entries; a run's files get the modes plain open()/mkdir would give them.
_FILE_MODE, _DIR_MODE = 0o666 & ~_umask(), 0o777 & ~_umask()


def plain_file_modes(folder: str | os.PathLike) -> None:
    """Give every file under `folder` the mode plain open() gives (0644 under umask 022): safetensors writes
    its files 0600, so an adapter would be the one file of a run its group cannot read."""
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), _FILE_MODE)


def fsync_dir(folder: Path) -> None:
    """Make the names in `folder` (new files, renames) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and Windows) refuse fsync on a directory: the rename still happened
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically and durably (temp file, fsync, rename, fsync the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync: a crash loses at most the line being written, never earlier ones.
    A reader skips a torn last line (see read_jsonl)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every complete JSON line of `path`; a torn last line (a crash mid-append) is skipped."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder` and every folder in it: what a library wrote with plain open()
    becomes durable before a marker says the folder is complete."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError), open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


@contextlib.contextmanager
def folder_as_one_unit(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; when the block ends without error, fsync it and swap it in.

    An existing `final` is renamed aside first and deleted only after the new one is in place, so a crash
    at any point leaves either the old folder, the new one, or (between the two renames) the old one under
    `<name>.old-<pid>` — never a mix of old and new files."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    tmp.chmod(_DIR_MODE)
    try:
        yield tmp
        plain_file_modes(tmp)
        fsync_tree(tmp)
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_disk_full(err: BaseException) -> bool:
    """A write failed because the disk (or the quota, or the file-size limit) is full, whatever raised it."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(err) for text in _DISK_FULL_TEXT) or all(text in str(err) for text in _SHORT_WRITE_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def disk_nearly_full(folder: Path, below_bytes: int = MIB) -> bool:
    """Under 1 MiB free where `folder` lives. torch.save's zip writer reports a failed write as "unexpected
    pos 64 vs 0", naming no errno; a crash while the disk is this full is reported as a full disk."""
    try:
        return shutil.disk_usage(folder).free < below_bytes
    except OSError:
        return False
