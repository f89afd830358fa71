"""helpers/cli.py's glmtune_in_process, which most command-line tests use, against the real command: the same exit code,
stdout and stderr for the same arguments, and nothing of the run left behind in the test process."""

import os
import re
import sys

from helpers.cli import glmtune, glmtune_in_process
from hydra.core.global_hydra import GlobalHydra


def output(proc) -> tuple:
    """Exit code, stdout and stderr, less what differs from run to run: log lines' timestamps, progress bars."""
    stamp = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]")

    def lines(text):
        return [stamp.sub("[time]", line) for line in re.split(r"[\r\n]", text) if line and "%|" not in line]

    return proc.returncode, lines(proc.stdout), lines(proc.stderr)


def test_in_process_runs_read_like_the_real_command(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant reply: exit 2
    cases = [
        # the plan's header and table on stdout, the advice line on stderr, exit 3, nothing written
        ("mode=plan", "model=glm4_9b_chat", "+hw=rtx4090_24g", "data.max_length=131072"),
        # a bad data line: the cache's log line on stdout, one error line on stderr, exit 2
        (f"data.train_file={data}", "data.val_file=null", f"hydra.run.dir={tmp_path / 'run'}"),
    ]
    for args in cases:
        real, here = glmtune(*args, cwd=tmp_path), glmtune_in_process(*args, cwd=tmp_path)
        assert output(here) == output(real), args
        assert real.returncode in (2, 3) and output(real)[2][-1].startswith("glmtune: error: "), real.stderr


def test_an_in_process_run_leaves_the_test_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMTUNE_TEST_MARK", "kept")
    env, argv, cwd = dict(os.environ), list(sys.argv), os.getcwd()
    proc = glmtune_in_process(
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=a100_40g",
        f"hydra.run.dir={tmp_path / 'p'}",
        env={"GLMTUNE_RUN_ID": "set-for-this-run"},
    )
    assert proc.returncode == 0 and "memory plan: fits" in proc.stdout, proc.stderr[-2000:]
    assert dict(os.environ) == env and sys.argv == argv and os.getcwd() == cwd
    assert not GlobalHydra.instance().is_initialized()


def test_an_uncaught_exception_reads_as_the_interpreter_reports_it(tmp_path, monkeypatch):
    from glmtune import __main__ as entry

    def broken(*args):
        raise RuntimeError("a bug inside a mode")

    monkeypatch.setattr(entry, "_execute", broken)
    proc = glmtune_in_process("mode=plan", f"hydra.run.dir={tmp_path / 'q'}")
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("RuntimeError: a bug inside a mode")
