"""The fullest micro-step packing can produce (data/packing.py), for the planner's estimate and the probe.

Packing lays each micro-batch's examples (the same ones as unpacked) first-fit into rows of up to pack_length
positions, and the collator pads the micro-batch to its longest row. The fullest row a micro-batch of m examples
of at most L positions can make holds min(pack_length, m x L) positions. The probe runs that layout: m equal
examples, as long as the data's longest, or a little shorter when that fills a row to within a few positions
(a row of k examples, k = ceil(pack_length / L)); whichever of the two pads to more positions, the fuller row
breaking a tie. The micro-step has then ceil(m / per row) rows of that length.

Not covered: adversarial length mixes can pad a micro-step to more rows of a full row (first-fit leaves every row
but the last more than pack_length - L full, so at most (m x L - 1) // (pack_length - L + 1) + 1 rows, and never
more than m). `most_rows` gives that bound, which the plan prints beside the probed layout.

The attention those rows run (models/kernels/attnpath.py: a dense mask up to a length, per document above) is named in
the plan by `path_figures` and `path_reason`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..models.kernels.attnpath import DENSE_MASK_MAX, packed_path


class MicroStep(NamedTuple):
    rows: int  # rows of the probed micro-step
    row_positions: int  # positions of each (all but possibly the last are this full; all are padded to it)
    example_positions: int  # positions of each of its examples
    per_row: int  # examples per row


def fullest_micro_step(micro_batch: int, longest: int, pack_length: int) -> MicroStep:
    """The layout the probe runs for micro-batches of `micro_batch` examples of at most `longest` positions."""
    if longest >= pack_length:  # every example alone in its row
        return MicroStep(micro_batch, longest, longest, 1)
    if micro_batch * longest <= pack_length:  # one row holds the whole micro-batch
        return MicroStep(1, micro_batch * longest, longest, micro_batch)
    candidates = []
    for each in {longest, pack_length // math.ceil(pack_length / longest)}:
        per_row = min(micro_batch, pack_length // each)
        rows = math.ceil(micro_batch / per_row)
        candidates.append(MicroStep(rows, per_row * each, each, per_row))
    return max(candidates, key=lambda s: (s.rows * s.row_positions, s.row_positions))


def most_rows(micro_batch: int, longest: int, pack_length: int) -> int:
    """The most rows first-fit can make of `micro_batch` examples of at most `longest` positions."""
    if longest >= pack_length:
        return micro_batch
    bound = (micro_batch * longest - 1) // (pack_length - longest + 1) + 1
    return max(1, min(micro_batch, bound))


def path_figures(requested: str, row_length: int) -> dict:
    """For the plan (plan/planner.py): the path of a row of `row_length` positions and the longest row given a
    dense [S, S] mask (None: every row; 0: none). auto is planned without FlexAttention: the planner cannot know
    that compiled blocks will run on a GPU that measured it (train/compile.py), and flex has no mask either."""
    longest_dense = DENSE_MASK_MAX if requested == "auto" else None if requested == "sdpa" else 0
    return {"attention": packed_path(requested, row_length), "dense_mask_max": longest_dense}


def path_reason(requested: str, figures: dict) -> str:
    """The plan's line: the probed row's path, and above which length no [S, S] tensor exists."""
    path = {
        "sdpa": "a dense block-diagonal mask",
        "segments": "per-document SDPA (segments)",
        "flex": "a FlexAttention block mask",
    }[figures["attention"]]
    rows = f"rows of {figures['probed_row_positions']} positions: {path}"
    if figures["dense_mask_max"] is None:
        return f"train.packed_attention=sdpa: {rows}, a [S, S] tensor at every length"
    if figures["dense_mask_max"] == 0:
        return f"train.packed_attention={requested}: {rows}, no [S, S] tensor at any length"
    return f"auto: {rows}; no [S, S] tensor in rows above {figures['dense_mask_max']} positions"
