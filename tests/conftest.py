"""Shared test set-up: a private tiny-checkpoint cache, offline Hugging Face, quiet tokenizers."""
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

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


def glmtune(*args, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    """`python -m glmtune ARGS` as a user types it (a real process: Hydra, the Trainer, torch's import)."""
    return subprocess.run([sys.executable, "-m", "glmtune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# One CLI training that several tests read (run dir files, console lines, probe equivalence, inference with
# its adapter): lora=all_linear at a high learning rate, so the adapter visibly changes the model.
TRAINED = ["lora=all_linear", "train.learning_rate=5e-3", "train.max_steps=6", "train.logging_steps=1",
           "train.per_device_batch_size=2", "lora.dropout=0.1"]


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> SimpleNamespace:
    """The tiny model trained twice through the CLI with TRAINED, with and without the probe, both launched at
    once (each process spends seconds importing torch). .with_probe/.without_probe are the run dirs,
    .proc/.proc_without the finished processes."""
    root = tmp_path_factory.mktemp("trained")
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(glmtune, *TRAINED, f"hydra.run.dir={root / 'with_probe'}")
        b = pool.submit(glmtune, *TRAINED, "probe.enabled=false", f"hydra.run.dir={root / 'without_probe'}")
        proc, proc_without = a.result(), b.result()
    assert proc.returncode == 0 and proc_without.returncode == 0, (proc.stderr[-3000:], proc_without.stderr[-3000:])
    return SimpleNamespace(with_probe=root / "with_probe", without_probe=root / "without_probe", proc=proc,
                           proc_without=proc_without)
