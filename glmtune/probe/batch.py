"""The worst batch the data can produce, which the probe measures: examples of the longest kept length whose every
token is a target (the loss head at its largest), and for GLM-4V a noise image of the tower's input size in each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data.pipeline import IMAGE_PLACEHOLDERS


def worst_case_examples(count: int, length: int, tokenizer, seed: int, image: Path | None = None) -> list[dict]:
    """`count` examples of exactly `length` random text tokens (no special ones), each one a target.
    With `image` (GLM-4V), every example carries it: its 3 placeholders right after [gMASK]<sop> become the
    tower's embeddings, so the sequence is as long as the longest image example can be."""
    gen = torch.Generator().manual_seed(seed)
    plain = tokenizer.vocab_size - len(tokenizer.specials)  # specials are numbered after the plain tokens
    rows = torch.randint(0, plain, (count, length), generator=gen).tolist()
    if image is None:
        return [{"input_ids": row, "labels": row} for row in rows]
    marks = [tokenizer.get_command(t) for t in IMAGE_PLACEHOLDERS]
    out = []
    for row in rows:
        row[2:5] = marks
        out.append({"input_ids": row, "labels": row[:2] + [-100] * 3 + row[5:], "image": str(image)})
    return out


def probe_image(size: int, folder: Path) -> Path:
    """A noise image of the tower's input size; pixel values do not change the tower's memory."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "probe_image.png"
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path
