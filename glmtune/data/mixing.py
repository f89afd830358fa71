"""Several train files mixed by examples, and a validation set held out of them, both drawn with the run's seed.

    data.train_file=[a.jsonl,b.jsonl] data.mix=[3,1]     a supplies 3/4 of the training examples, b 1/4
    data.val_size=0.1 (a fraction) or 200 (a count)      held out of the train files' kept examples first

Order of the draws: the val set is drawn uniformly from the kept examples of all train files pooled (each example
once); mixing then works on what is left. The mixed set has as many examples as the files have left in all (an
epoch is as long as the data), shared out by data.mix with largest remainders, so the counts are exact: a file
asked for fewer than it has gives a random subset, one asked for more gives every example `k` times plus a random
subset. Without data.mix every file gives each of its examples once. Same files, settings and seed: the same
selection; the Trainer then shuffles the order as ever.

A selection is a TokenizedSplit over the files' cache entries (one Arrow table, concatenated without copying),
whose `rows` lists the chosen table rows, repeats included, so packing and the collator see one split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa

from ..config import DataConfig
from .sources import DataError, is_rows
from .stats import FileStats, SplitStats, split_stats
from .tokenized import TokenizedSplit
from .validate import locate


def holdout_count(val_size: float, total: int, shown: str) -> int:
    """How many examples data.val_size holds out of `total`: a fraction (rounded, at least 1) or a count."""
    count = max(1, round(val_size * total)) if val_size < 1 else int(val_size)
    if count >= total:
        raise DataError(
            f"{shown}: data.val_size={val_size:g} holds out {count} of the {total} kept train examples, "
            "leaving none to train on — lower data.val_size or pass a data.val_file"
        )
    return count


def split_off(kept: Sequence[int], val_size: float, seed: int, shown: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val) example indices per file: `kept[i]` examples in file i, val drawn from all files pooled."""
    starts = np.cumsum([0, *kept])
    chosen = np.zeros(starts[-1], dtype=bool)
    if val_size > 0:
        rng = np.random.default_rng([seed, 1])  # its own stream: the mix draw below never shifts the val set
        chosen[rng.permutation(starts[-1])[: holdout_count(val_size, int(starts[-1]), shown)]] = True
    train = [np.flatnonzero(~chosen[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    val = [np.flatnonzero(chosen[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    return train, val


def mix_counts(available: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Examples each file supplies: sum(available) shared out by weight, largest remainders (exact total).
    The weights are scaled by their largest first: [1e308, 1e308] is an even mix, not a sum that overflows."""
    scaled = np.asarray(weights, dtype=np.float64) / max(weights)
    total, share = sum(available), scaled / scaled.sum()
    exact = share * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def mix(
    train: list[np.ndarray], weights: Optional[Sequence[float]], seed: int, files: Sequence[str]
) -> list[np.ndarray]:
    """Each file's chosen example indices (sorted, repeats adjacent): all of them without weights."""
    if weights is None:
        return train
    rng = np.random.default_rng([seed, 2])
    out = []
    for rows, count, shown in zip(train, mix_counts([len(r) for r in train], weights), files):
        if not len(rows):
            raise DataError(
                f"{shown}: data.val_size took every kept example of this file, so data.mix has none to "
                "draw from — lower data.val_size or add examples"
            )
        whole, rest = divmod(count, len(rows))
        out.append(np.sort(np.concatenate([np.tile(rows, whole), rng.permutation(rows)[:rest]])))
    return out


class Selection(TokenizedSplit):
    """Chosen examples of several cache entries as one split: `picks[i]` indexes entry i's kept examples, and
    `files[i]` is the data file as data.train_file names it."""

    def __init__(self, parts: Sequence[TokenizedSplit], picks: Sequence[np.ndarray], files: Sequence[str]) -> None:
        table = pa.concat_tables([p.table for p in parts]) if len(parts) > 1 else parts[0].table
        super().__init__(table, Path(parts[0].path), any(p.built for p in parts))
        starts = np.cumsum([0] + [p.table.num_rows for p in parts])
        self.rows = np.concatenate(
            [starts[i] + part.rows[pick] for i, (part, pick) in enumerate(zip(parts, picks))]
        ).astype(np.int64)
        self.parts = list(parts)  # the files' cache entries, in data.train_file order
        self.counts = [len(pick) for pick in picks]  # examples from each file
        self.files = list(files)
        self._picks = [part.rows[pick] for part, pick in zip(parts, picks)]

    def sources(self) -> list[tuple[str, list[int]]]:
        """(data file, line or row numbers) of the chosen examples, per file: where to re-read their conversations
        (eval.generate on a held-out val set)."""
        return [
            (file, part.column("line")[rows].tolist()) for file, part, rows in zip(self.files, self.parts, self._picks)
        ]


def selected(cfg: DataConfig, files: list[str], parts: list, per_image: int, seed: int):
    """The mixed train split and the held-out val split (None without data.val_size) with their stats."""
    splits = [split for split, _ in parts]
    train_picks, val_picks = split_off([len(s) for s in splits], cfg.val_size, seed, files[0])
    train_picks = mix(train_picks, cfg.mix, seed, files)
    train = Selection(splits, train_picks, files)
    val = Selection(splits, val_picks, files) if cfg.val_size else None
    # The train stats count what is trained (repeats included) and every file's dropped examples.
    dropped = np.concatenate(
        [
            np.flatnonzero(s.column("targets") == 0) + offset
            for s, offset in zip(splits, np.cumsum([0] + [s.table.num_rows for s in splits]))
        ]
    )
    train_stats = _rows_stats(train, np.concatenate([train.rows, dropped]), per_image)
    val_stats = _rows_stats(val, val.rows, per_image) if val is not None else None
    files_stats = tuple(
        FileStats(
            file=path,
            records=records_format(split),
            kept=stats.kept,
            dropped_lines=stats.dropped_lines,
            weight=cfg.mix[i] if cfg.mix else None,
            train=len(train_picks[i]),
            val=len(val_picks[i]),
            rows=is_rows(locate(path)),
        )
        for i, (path, (split, stats)) in enumerate(zip(files, parts))
    )
    return train, val, train_stats, val_stats, files_stats


def _rows_stats(split: TokenizedSplit, rows: np.ndarray, per_image: int) -> SplitStats:
    columns = (split.column(c)[rows] for c in ("line", "length", "untruncated", "targets", "image"))
    stats = split_stats(*columns, per_image)
    stats.dropped_lines = ()  # line numbers of several files: FileStats lists them per file
    return stats


def records_format(split: TokenizedSplit) -> str:
    """The record format the cache entry was built with (cache.py writes it into meta.json)."""
    return json.loads((Path(split.path) / "meta.json").read_text()).get("records", "?")
