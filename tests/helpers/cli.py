"""The command as tests run it: as a user types it, in a real process (`glmtune`), in a fresh interpreter that reports
what it imported or opened (`glmtune_inspected`), or through the same entry point in this process
(`glmtune_in_process`: no interpreter start, no torch import); the config composed as Hydra composes it
(`composed`); and the options of the shared CLI training (TRAINED, conftest's `trained`)."""

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

from . import REPO


def glmtune(*args, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    """`python -m glmtune ARGS` as a user types it (a real process: Hydra, the Trainer, torch's import)."""
    return subprocess.run(
        [sys.executable, "-m", "glmtune", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


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
    proc = subprocess.run(
        [sys.executable, "-c", _INSPECTED.format(setup=setup, report=report), json.dumps(args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("INSPECTED=")), None)
    assert line is not None, proc.stderr[-3000:]
    code, value = json.loads(line[len("INSPECTED=") :])
    return code, value, proc.stdout


@contextlib.contextmanager
def _log_streams(out, err):
    """Point every logging StreamHandler bound to the real stdout/stderr at out/err for the duration: libraries
    (transformers, datasets) bind sys.stderr when their handler is made, which may be before this run."""
    moved = []
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
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
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _log_streams(out, err),
            warnings.catch_warnings(),
        ):
            warnings.resetwarnings()  # the interpreter's defaults, not pytest's recorder
            for action, category in (
                ("default", Warning),
                ("ignore", DeprecationWarning),
                ("ignore", PendingDeprecationWarning),
                ("ignore", ImportWarning),
                ("ignore", ResourceWarning),
            ):
                warnings.simplefilter(action, category)
            warnings.showwarning = lambda msg, cat, fname, lineno, file=None, line=None: err.write(
                warnings.formatwarning(msg, cat, fname, lineno, line)
            )
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
TRAINED = [
    "lora=all_linear",
    "train.learning_rate=5e-3",
    "train.max_steps=6",
    "train.logging_steps=1",
    "train.per_device_batch_size=2",
    "lora.dropout=0.1",
]


def composed(overrides=()) -> dict:
    """conf/ composed with `overrides` as the command line composes it, resolved to a plain dict."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)
