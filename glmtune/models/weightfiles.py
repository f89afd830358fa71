"""A checkpoint's weight files, checked before any weights load (present, not cut short, no pickled code), and a
failed load blamed on the files only when what failed was reading them.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from ..config import ConfigError
from ..config.units import MIB


def check_weight_files(path: str | os.PathLike) -> list[Path]:
    """The folder's weight files, each checked without loading it: present, and not cut short.

    A safetensors file states every tensor's byte range in its header, so a truncated copy (an interrupted
    download, a full disk) is caught from its size; a torch .bin is a zip whose directory sits at the end, so
    truncation loses the directory. Returns the files; ConfigError names the first bad one."""
    folder = Path(path)
    index = next(
        (
            folder / n
            for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
            if (folder / n).is_file()
        ),
        None,
    )
    if index is not None:
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{index}: not a readable weight index (no weight_map) — re-download it") from None
        files = [folder / n for n in names]
    else:
        files = [folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).exists()][:1]
        if not files:
            raise ConfigError(
                f"{folder}: no weights (model.safetensors, pytorch_model.bin or a sharded index) — "
                "point model.path at a complete checkpoint folder"
            )
    for file in files:
        if not file.is_file():
            raise ConfigError(f"{file}: weight file missing — the checkpoint is incomplete; re-download it")
        problem = _safetensors_problem(file) if file.suffix == ".safetensors" else _torch_zip_problem(file)
        if problem:
            raise ConfigError(f"{file}: {problem} — the file is damaged or cut short; re-download it")
    return files


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"only {size} bytes, too short for a safetensors header"
        length = int.from_bytes(head, "little")
        if length > min(size - 8, 100 * MIB):  # the format caps headers at 100 MB
            return f"safetensors header claims {length} bytes, the file has {size}"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "safetensors header is not valid JSON"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size < 8 + length + end:
        return f"truncated: {size} bytes, its header needs {8 + length + end}"
    return None


def _torch_zip_problem(file: Path) -> str | None:
    import zipfile

    if not zipfile.is_zipfile(file):
        return "not a torch zip archive (truncated, or a legacy pickle glmtune does not load)"
    return None


# What torch.load / safetensors say of a file they cannot read (a RuntimeError may also come from elsewhere: a
# ZeRO-3 collective while the weights load, which is no reason to re-download anything).
_FILE_ERRORS = (
    "PytorchStreamReader",
    "zip archive",
    "safetensor",
    "deserializ",
    "header",
    "invalid load key",
    "unexpected EOF",
    "storage",
    "file",
)


def reading_error(err: BaseException) -> bool:
    return any(word.lower() in str(e).lower() for e in _chain(err) for word in _FILE_ERRORS)


def _chain(err: BaseException | None) -> list[BaseException]:
    chain, seen = [], set()
    while err is not None and id(err) not in seen:  # transformers re-raises while handling the real cause
        chain.append(err)
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return chain


def load_error(path, err: BaseException) -> str:
    """One line for a weight file transformers could not read, without its advice to "set from_tf=True"."""
    chain = _chain(err)
    if any(isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e) for e in chain):
        return (
            f"{path}: a .bin weight file holds pickled objects other than tensors, which torch refuses to load "
            "(weights_only=True) because unpickling runs code — use the checkpoint's .safetensors files, or "
            "convert the .bin with safetensors on a machine you trust"
        )
    root = chain[-1]
    first = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    return f"{path}: weights cannot be read ({first[:200]}) — re-download the checkpoint"
