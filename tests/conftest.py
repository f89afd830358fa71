"""Shared test set-up: a private tiny-checkpoint cache, offline Hugging Face, quiet tokenizers; the fixtures several
files use (the tiny tokenizer, the repo, the shared CLI training `trained`); what keeps the suite fast on few cores
(pytest-xdist threads and file order, gc.freeze). Timings: bench/RESULTS.md §8. Helpers that are not fixtures (the
command run in this process or as a real one, files tests write, launches) are in helpers/."""

import fcntl
import gc
import json
import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# One cache for the whole session (and the subprocesses it starts), so the tiny checkpoints are built once
# and never read from or written to the user's ~/.cache.
os.environ.setdefault("GLMTUNE_CACHE", tempfile.mkdtemp(prefix="glmtune-test-cache-"))
os.environ["HF_HUB_OFFLINE"] = "1"
# Remote code a test loads (trust_remote_code: the export tests' stand-in modeling files) is copied here, not into
# ~/.cache/huggingface/modules.
os.environ.setdefault("HF_MODULES_CACHE", os.path.join(os.environ["GLMTUNE_CACHE"], "hf_modules"))
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("OMP_NUM_THREADS", "2")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # an xdist worker (set before torch is imported): the cores shared
    # out, since N workers x 2 OpenMP threads on 2 cores would spin against each other
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))

# What several files share lives in helpers/ (importable: this folder is on sys.path); re-exported here for the
# test files that still import it from conftest.
from helpers import REPO  # noqa: E402
from helpers.cli import TRAINED, glmtune, glmtune_in_process, glmtune_inspected  # noqa: E402, F401
from helpers.reference import reference  # noqa: E402, F401 (the GLM-4-0414 reference checkpoints: a session fixture)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny GLM-4 tokenizer, written and loaded once per test module."""
    from glmtune.models.tokenizer_files import load_tokenizer, write_tiny_tokenizer  # torch after the thread setting

    folder = tmp_path_factory.mktemp("tok_glm4")
    write_tiny_tokenizer(folder, "glm4")
    return load_tokenizer(folder)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def pytest_collection_finish(session):
    """Move every object alive after collection (torch, transformers, ... ~400,000 of them) out of the cyclic
    garbage collector's view: each full collection then scans only what tests create. Without it a gc.collect()
    (the probe, transformers' model loading, accelerate's cache clearing) costs 0.3-0.7 s of CPU here."""
    gc.collect()
    gc.freeze()


# The files whose tests wait longest on launched processes (torchrun, signals, resumes), longest first: under
# `--dist loadfile` each file runs whole on one worker, so these start first instead of being the last to finish.
LONG_FIRST = (
    "test_scaleout.py",
    "test_engines.py",
    "test_durable.py",
    "test_distributed.py",
    "test_sweeps.py",
    "test_evaluation.py",
    "test_cli.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> SimpleNamespace:
    """The tiny model trained twice through the CLI entry point (in this process) with TRAINED, with and without
    the probe. .with_probe/.without_probe are the run dirs, .proc/.proc_without the finished runs. Under
    pytest-xdist the first worker to ask trains, in the session's shared temp folder, and the others wait on its
    lock and read the same runs (the tests only read them)."""
    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    root = tmp_path_factory.getbasetemp().parent / "trained" if shared else tmp_path_factory.mktemp("trained")
    root.mkdir(exist_ok=True)
    record = root / "runs.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.is_file():
            runs = [
                glmtune_in_process(*TRAINED, f"hydra.run.dir={root / 'with_probe'}"),
                glmtune_in_process(*TRAINED, "probe.enabled=false", f"hydra.run.dir={root / 'without_probe'}"),
            ]
            record.write_text(json.dumps([vars(run) for run in runs]))
        proc, proc_without = (subprocess.CompletedProcess(**run) for run in json.loads(record.read_text()))
    assert proc.returncode == 0 and proc_without.returncode == 0, (proc.stderr[-3000:], proc_without.stderr[-3000:])
    return SimpleNamespace(
        with_probe=root / "with_probe", without_probe=root / "without_probe", proc=proc, proc_without=proc_without
    )
