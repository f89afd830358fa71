"""mkdocs hooks (mkdocs.yml `hooks:`): the two pages made at build time, so neither can drift from its source.

- results.md is bench/RESULTS.md itself, each numbered section given the anchor `#sN` (`## 26. ...` -> `#s26`),
  so pages cite a measurement as `[...](results.md#s26)` and `mkdocs build --strict` fails on a section that is
  gone (validation.anchors);
- layout.md's `<!-- generated: layout -->` line becomes docs/gen_layout.py's tables (package docstrings and the
  rules of tests/test_layout.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_layout  # noqa: E402  (a sibling file, imported after its folder is on the path)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "RESULTS.md"


def results_page(text: str) -> str:
    """RESULTS.md with `{#sN}` on each `## N. title` heading (attr_list) and a line saying where it comes from."""
    body = re.sub(r"^(## (\d+)\. .*?)\s*$", r"\1 {#s\2}", text, flags=re.MULTILINE)
    return body.replace("\n", "\n\n_This page is `bench/RESULTS.md`; edit it there._\n", 1)


def on_files(files, config):
    files.append(File.generated(config, "results.md", content=results_page(RESULTS.read_text(encoding="utf-8"))))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "layout.md":
        return gen_layout.fill(markdown, REPO)
    return markdown
