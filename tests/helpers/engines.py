"""Where the serving-engine venv is: vLLM (CPU build) and transformers 5.x, kept apart from glmtune's own stack
(transformers 4.40.2), for the engine-parity and reference-parity tests.

`scripts/engines-env.sh` makes `<repo>/.venv-engines` (the README's test block runs it, so CI has it);
`GLMTUNE_ENGINES_PYTHON` points at another interpreter (a venv made elsewhere). A missing venv fails the test that
needs it with the command that makes it, never a skip: a skip would let CI pass without the engines.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from . import REPO


def engines_python() -> Path:
    chosen = os.environ.get("GLMTUNE_ENGINES_PYTHON")
    python = Path(chosen) if chosen else REPO / ".venv-engines" / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"no engines venv at {python}: run scripts/engines-env.sh (or set GLMTUNE_ENGINES_PYTHON)", pytrace=False
        )
    return python


def run_in_engines(script: str, *args: str, timeout: int = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a Python file with the engines venv's interpreter, glmtune's checkout off its path (the engine must load
    the artifact with nothing of glmtune's), offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return subprocess.run(
        [str(engines_python()), script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or Path(script).parent,
    )
