"""Build one split's cache entry: every line checked (validate.check_line) and encoded (the encoder pipeline.py
hands in) by `datasets.map` on the node's cores, then saved with `save_to_disk`.

    lines.arrow   line number, byte offset and raw bytes of each non-blank line (written in 10,000-line batches,
                  so the builder never holds the file as 200K Python strings)
    map           num_proc workers, each on a contiguous shard, with datasets' progress bar on stderr
    checks        the same one-line DataErrors as validate.read_conversations, with the same line numbers
    dataset/      the rows (tokenized.COLUMNS) in file order; the scratch files are deleted

Stops: the workers are forked from the launcher without its stop-signal handler (launch/signals.py resets it in
every forked child): Ctrl-C's SIGINT, which reaches the whole foreground group, and SIGUSR1 are left to the
launcher, which stops the build and terminates the pool (SIGTERM, default action). Every process the builder
forks asks the kernel, at the fork, to SIGKILL it when the launcher dies (PR_SET_PDEATHSIG,
`_die_with_the_builder`), so a `kill -9` of the launcher leaves no worker behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa

from .sources import where
from .validate import DataError, _one_line, _Problem, check_line, no_conversations

_LINES_SCHEMA = pa.schema([("line", pa.int32()), ("start", pa.int64()), ("raw", pa.binary())])
_BATCH_LINES = 10_000  # lines per Arrow record batch of the raw-lines file
_MAP_BATCH = 256  # conversations per call of the worker function: small, so a worker's lists stay small
_ROWS_PER_WORKER = 2_000  # below this many lines per extra process, starting the process costs more than it saves
_BUILDER: int | None = None  # pid of the process running build_split; a forked worker inherits the value
_READY: int | None = None  # pid of the worker that has run _as_worker


def _as_worker() -> None:
    """Once in each forked map worker: leave stop signals to the launcher, and die with it."""
    global _READY
    if _READY == os.getpid() or _BUILDER in (None, os.getpid()):  # done, or the map runs in the launcher itself
        return
    _READY = os.getpid()  # the stop signals were reset at the fork (launch/signals.py StopSignals._in_child)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != _BUILDER:  # the launcher died before the line above: nothing to build for
        os._exit(1)


def _die_with_the_builder() -> None:
    """In every process the builder forks (the map workers, and the manager process datasets starts for their
    progress queue), at the fork itself: SIGKILL when the builder dies. Set on the first batch only, a manager
    or a worker still starting outlived a `kill -9` of the launcher, holding its stdout and stderr open."""
    if _BUILDER is None or os.getppid() != _BUILDER:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != _BUILDER:  # the builder died before the line above
        os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_die_with_the_builder)


def write_lines(items: Iterable[tuple[int, int, bytes]], path: Path) -> int:
    """The file's non-blank records (sources.records: line or row number, byte offset, raw JSON) into an Arrow
    stream file; returns how many. Line numbers and byte offsets count every line, blank or not."""
    count, batch = 0, {"line": [], "start": [], "raw": []}
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, _LINES_SCHEMA) as writer:
        for line_no, start, chunk in items:
            batch["line"].append(line_no)
            batch["start"].append(start)
            batch["raw"].append(chunk)
            count += 1
            if len(batch["line"]) == _BATCH_LINES:
                writer.write_batch(pa.record_batch(batch, schema=_LINES_SCHEMA))
                batch = {k: [] for k in batch}
        if batch["line"]:
            writer.write_batch(pa.record_batch(batch, schema=_LINES_SCHEMA))
    return count


def encode_rows(
    batch: dict[str, list], tokenizer: Any, max_length: int, folder: str, encode: Callable, fmt: str = "glm"
) -> dict[str, list]:
    """datasets.map worker: check and encode a batch of raw lines. A bad line becomes a row with its problem."""
    _as_worker()
    out: dict[str, list] = {
        k: [] for k in ("line", "input_ids", "labels", "length", "untruncated", "targets", "image", "what", "fix")
    }
    for line_no, start, raw_line in zip(batch["line"], batch["start"], batch["raw"]):
        result = check_line(raw_line, line_no, start, Path(folder), fmt=fmt)
        if result is None:  # blank after decoding (e.g. only U+3000 ideographic spaces)
            continue
        if isinstance(result, _Problem):
            row = (line_no, [], [], 0, 0, 0, None, result.what, result.fix)
        else:
            image = next((m["image"] for m in result if "image" in m), None)
            try:
                ids, labels, untruncated, targets = encode(result, tokenizer, max_length)
            except ValueError as err:  # what the checkpoint's own chat template cannot render (glm4_0414/template.py)
                out_row = (
                    line_no,
                    [],
                    [],
                    0,
                    0,
                    0,
                    None,
                    str(err),
                    "change this conversation so the model's chat template can render it, or leave it out",
                )
                for key, value in zip(out, out_row):
                    out[key].append(value)
                continue
            if not targets:  # dropped: only its line and lengths are kept, for the stats
                row = (line_no, [], [], len(ids), untruncated, 0, image, None, None)
            else:
                row = (line_no, ids, labels, len(ids), untruncated, targets, image, None, None)
        for key, value in zip(out, row):
            out[key].append(value)
    return out


def default_num_proc(lines: int) -> int:
    """Every core this process may use, but at least _ROWS_PER_WORKER lines per process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, lines // _ROWS_PER_WORKER))


def build_split(
    lines_file: Path,
    out: Path,
    shown: str,
    key: str,
    fingerprint: str,
    folder: Path,
    tokenizer: Any,
    max_length: int,
    has_vision: bool,
    encode: Callable,
    num_proc: int,
    fmt: str = "glm",
    rows: bool = False,
) -> None:
    """Encode lines_file into out/dataset; raise DataError (the file's first bad line) instead when it is bad.
    shown: the file as the user wrote it; key: the config key naming it; fingerprint: the cache key;
    fmt: the record format (formats.py); rows: the file's records are rows, not lines (sources.is_rows)."""
    import datasets  # ~1-2 s of imports, paid by the builder only

    global _BUILDER
    _BUILDER = os.getpid()

    features = datasets.Features(
        {
            "line": datasets.Value("int32"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "length": datasets.Value("int32"),
            "untruncated": datasets.Value("int32"),
            "targets": datasets.Value("int32"),
            "image": datasets.Value("string"),
            "what": datasets.Value("string"),
            "fix": datasets.Value("string"),
        }
    )
    lines = datasets.Dataset.from_file(str(lines_file))
    scratch = lines_file.parent
    try:
        encoded = _map(
            lines, features, tokenizer, max_length, folder, encode, fingerprint, scratch, shown, num_proc, fmt
        )
    except Exception as err:
        # A stop signal raises a BaseException (launch/signals.Interrupted, KeyboardInterrupt) in this process;
        # datasets' multi-process map then collects its workers' results in a `finally` and raises a TimeoutError
        # in its place. The signal is what happened: re-raise it, so the launcher stops with its one line.
        cause = err.__context__
        while cause is not None and isinstance(cause, Exception):
            cause = cause.__context__
        if cause is not None:
            raise cause from None
        raise
    _check(encoded.data, shown, key, has_vision, rows)
    datasets.disable_progress_bars()  # "Saving the dataset" is milliseconds here and tells the user nothing
    try:
        encoded.remove_columns(["what", "fix"]).save_to_disk(str(out / "dataset"))
    finally:
        datasets.enable_progress_bars()
    del encoded, lines
    shutil.rmtree(scratch, ignore_errors=True)


def _map(
    lines: Any,
    features: Any,
    tokenizer: Any,
    max_length: int,
    folder: Path,
    encode: Callable,
    fingerprint: str,
    scratch: Path,
    shown: str,
    num_proc: int,
    fmt: str,
) -> Any:
    return lines.map(
        encode_rows,
        batched=True,
        batch_size=_MAP_BATCH,
        writer_batch_size=1000,
        remove_columns=lines.column_names,
        features=features,
        num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_length": max_length,
            "folder": str(folder),
            "encode": encode,
            "fmt": fmt,
        },
        # A fingerprint of our own: datasets would otherwise hash the tokenizer (150K entries) with dill.
        new_fingerprint=f"glmtune-{fingerprint[:32]}",
        cache_file_name=str(scratch / "encoded.arrow"),
        desc=f"glmtune: tokenizing {Path(shown).name}",
    )


def _check(table: Any, shown: str, key: str, has_vision: bool, rows: bool = False) -> None:
    """The errors validate.read_conversations and the encoder raise, in the same order and words."""
    if table.num_rows == 0:  # datasets.map on no rows may not add the output columns at all
        raise DataError(no_conversations(shown, key))
    what = table.column("what")
    if what.null_count < len(what):
        bad = np.flatnonzero(what.is_valid().to_numpy(zero_copy_only=False))
        lines, whats, fixes = (table.column(c).take(pa.array(bad)).to_pylist() for c in ("line", "what", "fix"))
        raise DataError(_one_line(shown, [_Problem(*p) for p in zip(lines, whats, fixes)], rows))
    image = table.column("image")
    if not has_vision and image.null_count < len(image):
        line = table.column("line")[int(np.argmax(image.is_valid().to_numpy(zero_copy_only=False)))].as_py()
        raise DataError(
            f'{where(shown, line, rows)}: has an "image" but this model has no vision tower — use '
            "model=glm4v_9b (or glm4v_tiny), or drop the image"
        )
