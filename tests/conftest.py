"""Shared test set-up: a private tiny-checkpoint cache, offline Hugging Face, quiet tokenizers."""
import os
import tempfile
from pathlib import Path

import pytest

# One cache for the whole session (and the subprocesses it starts), so the tiny checkpoints are built once
# and never read from or written to the user's ~/.cache.
os.environ.setdefault("GLMTUNE_CACHE", tempfile.mkdtemp(prefix="glmtune-test-cache-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
