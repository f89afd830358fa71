"""Shared test set-up: a private tiny-checkpoint cache, offline Hugging Face, quiet tokenizers; the command run
in this process (glmtune_in_process) or as a real one (glmtune); the shared CLI training (trained); what keeps the
suite fast on few cores (pytest-xdist threads and file order, gc.freeze). Timings: bench/RESULTS.md §8."""
import contextlib
import fcntl
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
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

REPO = Path(__file__).resolve().parents[1]


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
LONG_FIRST = ("test_scaleout.py", "test_engines.py", "test_durable.py", "test_distributed.py", "test_sweeps.py",
              "test_evaluation.py", "test_cli.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: the rest keep their order


def glmtune(*args, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    """`python -m glmtune ARGS` as a user types it (a real process: Hydra, the Trainer, torch's import)."""
    return subprocess.run([sys.executable, "-m", "glmtune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# `python -m glmtune ARGS` in a fresh interpreter that prints, after the run, its exit code and an expression
# evaluated there (glmtune_inspected).
_INSPECTED = """
import json, runpy, sys
{setup}
sys.argv = ["glmtune", *json.loads(sys.argv[1])]
try:
    runpy.run_module("glmtune", run_name="__main__")
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print("INSPECTED=" + json.dumps([code, {report}]))
"""


def glmtune_inspected(args: list[str], cwd, report: str, setup: str = "") -> tuple[int, object, str]:
    """(exit code, the value of `report`, stdout) of `python -m glmtune ARGS` run in a fresh interpreter: `report`
    is a Python expression evaluated there after the run (e.g. `sorted(sys.modules)`), `setup` code run before
    glmtune is imported (e.g. an audit hook). For what only the process itself can tell: what it imported, opened."""
    proc = subprocess.run([sys.executable, "-c", _INSPECTED.format(setup=setup, report=report), json.dumps(args)],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("INSPECTED=")), None)
    assert line is not None, proc.stderr[-3000:]
    code, value = json.loads(line[len("INSPECTED="):])
    return code, value, proc.stdout


@contextlib.contextmanager
def _log_streams(out, err):
    """Point every logging StreamHandler bound to the real stdout/stderr at out/err for the duration: libraries
    (transformers, datasets) bind sys.stderr when their handler is made, which may be before this run."""
    moved = []
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler}:
        if handler.stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
            moved.append((handler, handler.stream))
            handler.setStream(out if handler.stream in (sys.stdout, sys.__stdout__) else err)
    try:
        yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)


def glmtune_in_process(*args, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    """`glmtune ARGS` through the same entry point (`glmtune.__main__.cli`: argument checks, Hydra, the modes,
    the exit paths), in this process: no interpreter start nor torch/transformers/deepspeed import (~4 s of CPU
    each). For tests of what glmtune does with a command line, not of the process boundary (signals, launchers,
    the installed command keep `glmtune`). The result reads like a subprocess's: exit code as `sys.exit` or an
    uncaught exception (1, its traceback on stderr) would give it; stdout and stderr as text; Python's default
    warning filters, so a warning shows once per run as in a fresh process. Environment, cwd, argv, Hydra's
    global state and the root logger are restored after. Not for torch.distributed runs (a process group
    outlives the call)."""
    from hydra.core.global_hydra import GlobalHydra

    from glmtune import __main__ as entry

    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    # Real files, not StringIO: code that redirects the stderr fd (sentencepiece's trainer, for the tiny
    # ChatGLM3 tokenizer) needs a fileno.
    out, err = tempfile.TemporaryFile("w+", encoding="utf-8"), tempfile.TemporaryFile("w+", encoding="utf-8")
    code = 0
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        sys.argv = ["glmtune", *map(str, args)]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _log_streams(out, err), \
                warnings.catch_warnings():
            warnings.resetwarnings()  # the interpreter's defaults, not pytest's recorder
            for action, category in (("default", Warning), ("ignore", DeprecationWarning),
                                     ("ignore", PendingDeprecationWarning), ("ignore", ImportWarning),
                                     ("ignore", ResourceWarning)):
                warnings.simplefilter(action, category)
            warnings.showwarning = lambda msg, cat, fname, lineno, file=None, line=None: err.write(
                warnings.formatwarning(msg, cat, fname, lineno, line))
            try:
                entry.cli()
            except SystemExit as exc:  # what the interpreter does with it
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=err)
                    code = 1
            except Exception:  # noqa: BLE001 - an uncaught exception: traceback on stderr, exit 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
        for handler in set(root.handlers) - set(saved_root[0]):  # Hydra's console and run-dir log file
            handler.close()
        root.handlers[:], root.level = saved_root
        gc.collect()  # the run's model and Trainer, before the next test allocates its own
        gc.freeze()  # what survives (modules the run imported) is never scanned again: see pytest_collection_finish
    texts = []
    for stream in (out, err):
        stream.seek(0)
        texts.append(stream.read())
        stream.close()
    return subprocess.CompletedProcess(["glmtune", *args], code, *texts)


# One CLI training that several tests read (run dir files, console lines, probe equivalence, inference with
# its adapter): lora=all_linear at a high learning rate, so the adapter visibly changes the model.
TRAINED = ["lora=all_linear", "train.learning_rate=5e-3", "train.max_steps=6", "train.logging_steps=1",
           "train.per_device_batch_size=2", "lora.dropout=0.1"]


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
            runs = [glmtune_in_process(*TRAINED, f"hydra.run.dir={root / 'with_probe'}"),
                    glmtune_in_process(*TRAINED, "probe.enabled=false", f"hydra.run.dir={root / 'without_probe'}")]
            record.write_text(json.dumps([vars(run) for run in runs]))
        proc, proc_without = (subprocess.CompletedProcess(**run) for run in json.loads(record.read_text()))
    assert proc.returncode == 0 and proc_without.returncode == 0, (proc.stderr[-3000:], proc_without.stderr[-3000:])
    return SimpleNamespace(with_probe=root / "with_probe", without_probe=root / "without_probe", proc=proc,
                           proc_without=proc_without)
