"""The tokenized-data cache: each data file is checked and encoded once into an Arrow entry that later launches
and every rank open memory-mapped, instead of every rank re-reading and re-tokenizing the JSONL on every launch.

    data.cache_dir=null          -> $GLMTUNE_CACHE/data (default ~/.cache/glmtune/data)
    <cache_dir>/<stem>-<key>/        the entry: dataset/ (a `datasets.save_to_disk` folder) and meta.json
    <cache_dir>/<stem>-<key>.lock    locked (lockf) by the one process that builds the entry
    <cache_dir>/<stem>-<key>.error   the builder's DataError, for the processes that waited on it

The key hashes everything the rows depend on: the file's bytes, its folder (relative image paths resolve against
it), the tokenizer files, data.max_length, the model family and whether it has a vision tower, and the source of
the code that validates and encodes (validate.py, pipeline.py, build.py, the tokenizers). Any change gives a new
entry; an unchanged input costs one read and sha256 of the file (~0.2 s per 100 MB) and a memory-mapped open.
Entries are never modified, so old ones may be deleted at any time (rm -r) when no launch is using them.
meta.json records the sha256 of every file of the entry's dataset/, checked at every open (the whole entry is
read once; the pages stay cached for training): an entry whose files differ (a flipped bit, a truncated or
replaced file, an entry from before the checksums, a folder without meta.json) is never trained on: it is moved
aside and built again.

Who builds: the first process to take the entry's lock. With a node-local cache_dir that is one process per
node, on a shared filesystem one for the whole job; the other ranks block on the lock meanwhile and then find
the entry (renamed into place, complete, in one atomic step) or the builder's error. A builder that dies
releases the lock with its life; the next process deletes the half-built folder and builds again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..config import DataConfig
from ..config.units import MIB
from ..models.presets import cache_root
from .build import build_split, default_num_proc, write_lines
from .sources import digest, is_rows, records
from .tokenized import TokenizedSplit
from .validate import DataError, _read_bytes, file_format, locate

FORMAT = 1  # the entry layout (tokenized.COLUMNS, meta.json); bump on a change the source hash would not catch
# Code whose change changes the rows: its source text is part of the key (no version number to forget).
_CODE = (
    "data/validate.py",
    "data/pipeline.py",
    "data/build.py",
    "data/formats.py",
    "data/sources.py",
    "models/chatglm/tokenization.py",
    "models/chatglm/tokenization_glm4.py",
    "models/chatglm/tokenization_chatglm3.py",
    "models/glm4_0414/tokenization.py",
    "models/glm4_0414/template.py",
)
log = logging.getLogger(__name__)


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root() / "data"


def load_split(
    cfg: DataConfig, path: str, config_key: str, tokenizer: Any, has_vision: bool, encode: Callable
) -> TokenizedSplit:
    """The split of data file `path` (named by `config_key`, e.g. data.train_file): opened from its cache entry,
    or validated, encoded with `encode` (pipeline.encode_example) and cached first. DataError on a bad file."""
    started = time.time()
    located = locate(path)  # data/samples/... falls back to the copy shipped inside glmtune
    raw = _read_bytes(located, str(path), config_key)  # the validation messages for missing/unreadable files
    folder = located.expanduser().resolve().parent
    fmt = file_format(cfg.format, located, str(path), raw)  # auto: from the first record that parses
    fields = {
        "format": FORMAT,
        "data_sha256": digest(located, raw),
        "folder": str(folder),
        "records": fmt,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "max_length": cfg.max_length,
        "family": tokenizer.family,
        "vision": has_vision,
        "code_sha256": code_sha256(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
    root = cache_dir(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"{root}: cannot create the data cache ({err.strerror or err}) — set data.cache_dir to a writable folder"
        ) from None
    entry = root / f"{Path(path).stem}-{key}"
    if (entry / "meta.json").is_file() and damage(entry) is None:
        return _opened(entry, False, started)
    with _locked(entry.with_name(entry.name + ".lock"), entry):
        if (entry / "meta.json").is_file():  # built by the process we waited for, or damaged
            problem = damage(entry)
            if problem is None:
                return _opened(entry, False, started)
        elif entry.exists() or entry.is_symlink():
            # No builder ever leaves this (it renames a folder with meta.json into place whole, under this lock,
            # which we hold): meta.json was deleted by hand, or the folder came from elsewhere. Nobody opens an
            # entry without meta.json, so it is set aside like a damaged one and built again.
            problem = "no meta.json"
        else:
            problem = None
        if problem is not None:
            log.warning("data: cache entry %s is damaged (%s): building it again", entry, problem)
            aside = root / f".{entry.name}.tmp-damaged-{os.getpid()}"
            os.rename(entry, aside)  # processes that have it open keep their mapping; nobody opens it again
            if aside.is_dir() and not aside.is_symlink():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                aside.unlink(missing_ok=True)
        error_file = entry.with_name(entry.name + ".error")
        if error_file.is_file() and error_file.stat().st_mtime >= started - 1:  # it failed while we waited
            raise DataError(error_file.read_text(encoding="utf-8"))
        for stale in root.glob(f".{entry.name}.tmp-*"):  # left by a builder that died; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}"
        (tmp / "scratch").mkdir(parents=True)
        try:
            lines = write_lines(records(located, str(path), raw), tmp / "scratch" / "lines.arrow")
            del raw  # 1 byte per byte of the file: not kept through the map (forked workers would inherit it)
            num_proc = cfg.num_proc or default_num_proc(lines)
            log.info("data: building the cache entry %s for %s (%d lines, num_proc=%d)", entry, path, lines, num_proc)
            build_split(
                tmp / "scratch" / "lines.arrow",
                tmp,
                str(path),
                config_key,
                key,
                folder,
                tokenizer,
                cfg.max_length,
                has_vision,
                encode,
                num_proc,
                fmt,
                is_rows(located),
            )
            meta = {
                **fields,
                "file": str(Path(path).resolve()),
                "lines": lines,
                "host": socket.gethostname(),
                "build_seconds": round(time.time() - started, 1),
                "files_sha256": files_sha256(tmp),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            os.rename(tmp, entry)  # atomic: other processes see no entry or a complete one
        except DataError as err:
            _write_atomic(error_file, str(err))
            raise
        except OSError as err:  # pyarrow and datasets report a full disk as OSError, naming no file
            if not _disk_full(err, root):
                raise
            raise DataError(
                f"{root}: disk full or over quota building the data cache entry for {path} "
                f"({str(err).splitlines()[0][:120]}) — free space there or set data.cache_dir to a "
                "folder with room, then re-run the same command"
            ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        error_file.unlink(missing_ok=True)
    return _opened(entry, True, started)


def files_sha256(entry: Path) -> dict[str, str]:
    """sha256 of every file under the entry's dataset/ folder, by relative path."""
    found = {}
    for file in sorted((entry / "dataset").rglob("*")):
        if file.is_file():
            digest = hashlib.sha256()
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(MIB), b""):
                    digest.update(block)
            found[file.relative_to(entry).as_posix()] = digest.hexdigest()
    return found


def damage(entry: Path) -> str | None:
    """What is wrong with a cache entry's files (None: they are exactly what its builder wrote)."""
    try:
        recorded = json.loads((entry / "meta.json").read_text()).get("files_sha256")
        if not recorded:
            return "no checksums recorded (an entry from an older glmtune)"
        found = files_sha256(entry)
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    changed = sorted(name for name in recorded.keys() | found.keys() if recorded.get(name) != found.get(name))
    return f"{', '.join(changed[:3])} differ from the checksums written when it was built" if changed else None


def _opened(entry: Path, built: bool, started: float) -> TokenizedSplit:
    try:
        split = TokenizedSplit.open(entry, built)
    except (OSError, ValueError, KeyError) as err:  # pyarrow's errors are OSError/ValueError subclasses
        raise DataError(
            f"{entry}: data cache entry is damaged ({type(err).__name__}: {err}) — delete that folder and launch again"
        ) from None
    log.info(
        "data: %d examples from %s (%s) in %.2f s",
        len(split),
        entry,
        "built" if built else "cached",
        time.time() - started,
    )
    return split


@contextmanager
def _locked(lock_file: Path, entry: Path) -> Iterator[None]:
    """An exclusive lock on lock_file, waited for (with one log line) when another process holds it.

    A POSIX record lock (lockf), not flock: a forked map worker does not inherit it, so the lock ends with the
    process that took it even if a worker outlived it (an flock stays while any forked copy of the fd lives)."""
    with open(lock_file, "a+") as handle:
        try:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, by platform
                log.info("data: waiting for another process building %s", entry)
                fcntl.lockf(handle, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            raise DataError(
                f"{lock_file.parent}: this filesystem has no file locks ({err.strerror}) — set "
                "data.cache_dir to a local folder (or one with locking enabled)"
            ) from None
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def _disk_full(err: OSError, root: Path) -> bool:
    """ENOSPC/EDQUOT/EFBIG, or under 1 MiB left where the cache lives (a library that lost the errno)."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "No space left on device" in str(err):
        return True
    try:
        return shutil.disk_usage(root).free < MIB
    except OSError:
        return False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def code_sha256() -> str:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _CODE:
        digest.update(name.encode() + b"\0" + (package / name).read_bytes() + b"\0")
    return digest.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """The hash of the files the tokenizer was loaded from (load_tokenizer records it); a tokenizer built in
    memory is saved to a temporary folder and that is hashed."""
    recorded = getattr(tokenizer, "files_sha256", None)
    if recorded:
        return recorded
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        digest = hashlib.sha256()
        for file in sorted(Path(folder).iterdir()):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
        return digest.hexdigest()
