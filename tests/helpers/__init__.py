"""What several test files share, in one importable place (tests/ is on sys.path, as conftest.py's folder): the
command as tests run it (`cli.py`), launches of several ranks (`launch.py`), the small files tests write
(`files.py`), the serving engines' venv (`engines.py`) and the transformers-5 reference of GLM-4-0414
(`reference.py`). Fixtures that every folder uses are conftest.py's."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: conf/, data/, scripts/, bench/
BIN = Path(sys.executable).parent  # this interpreter's torchrun and deepspeed
