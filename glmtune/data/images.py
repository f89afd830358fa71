"""Check one training image completely at validation time: a regular file, a sane size, decodable to the end.

Opening a file only reads its header, so a truncated PNG passed validation and crashed mid-training
without naming its data line, a 20000x20000 PNG tripped Pillow's decompression-bomb guard (an exception
that is not an OSError) with a traceback, and a FIFO given as a path blocked the open() forever. Each
becomes a (what is wrong, what to do) pair for the data line's one-line message.
"""

from __future__ import annotations

import stat
from pathlib import Path

# Pillow's own decompression-bomb threshold (about 89 megapixels, ~268 MB decoded as RGB). GLM-4V resizes
# every image to 1120x1120 (1.25 MP), so a larger source only costs decoding time and memory.
MAX_PIXELS = 89_478_485


def image_problem(image: Path) -> tuple[str, str] | None:
    try:
        mode = image.stat().st_mode  # stat, not open: opening a FIFO blocks until a writer appears
    except FileNotFoundError:
        return f"image not found: {image}", "fix the path (relative paths are relative to the data file's folder)"
    except OSError as err:
        return f"image cannot be read: {image} ({err.strerror or err})", "check the file's permissions"
    if not stat.S_ISREG(mode):
        return (
            f"image is not a regular file: {image} (a folder, FIFO, socket or device)",
            'point "image" at an image file',
        )
    return decode_problem(image, str(image))


def decode_problem(source, shown: str) -> tuple[str, str] | None:
    """(what is wrong, what to do) when `source` (a path or a binary file object) is not an image GLM-4V can
    take whole: over the pixel cap, or not decodable to its last byte. `shown` names it in the message."""
    from PIL import Image

    try:
        with Image.open(source) as img:
            width, height = img.size
            if width * height > MAX_PIXELS:
                return (
                    f"image is {width}x{height} pixels, over the {MAX_PIXELS / 1e6:.0f}-megapixel limit: {shown}",
                    "downscale it (GLM-4V sees every image at 1120x1120 anyway)",
                )
            img.load()  # decode every byte: a truncated or corrupt file fails here, not mid-training
    except Image.DecompressionBombError:
        return (
            f"image is over the {MAX_PIXELS / 1e6:.0f}-megapixel limit: {shown}",
            "downscale it (GLM-4V sees every image at 1120x1120 anyway)",
        )
    except (OSError, ValueError, SyntaxError) as err:  # UnidentifiedImageError is an OSError; truncation too
        return (
            f"image cannot be read: {shown} ({str(err).splitlines()[0][:80] if str(err) else type(err).__name__})",
            "check that the file is a complete PNG/JPEG/WebP image",
        )
    return None
