"""The console of a default tiny run carries glmtune's own lines only: no Hydra-format log lines, no warnings
from other packages, no Python dicts, no bars but glmtune's tokenizing bar and the Trainer's progress bar; tables
are not cut when stdout is not a terminal; the closing line names the best adapter."""
import re

from glmtune.train.progress import step_line

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FOREIGN = (re.compile(r"^\[\d{4}-\d\d-\d\d"),  # Hydra's log format: INFO belongs in rank<N>.log
           re.compile(r"Warning|warn\(", re.I), re.compile(r"^\{'"), re.compile(r"Saving the dataset"),
           re.compile(r"^\[rank\d"), re.compile(r"Traceback"))
BAR = re.compile(r"^(glmtune: tokenizing \S+: )?\s*\d+%\|")


def test_a_default_tiny_run_prints_only_glmtune_s_lines(trained):
    out, err = trained.proc.stdout, trained.proc.stderr
    for line in out.splitlines():
        assert not any(p.search(line) for p in FOREIGN), line
        assert "…" not in line, line  # a table cut to the console width (stdout here is a pipe, not a TTY)
    for line in ANSI.sub("", err).replace("\r", "\n").splitlines():
        assert not line.strip() or BAR.match(line), line
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps and all(": loss " in s or ": eval " in s for s in steps), steps
    closing = out.strip().splitlines()[-1]
    assert closing.startswith("done in ") and "adapter saved to" in closing and "adapter_best" in closing


def test_step_lines_are_short_and_readable():
    line = step_line(5, {"loss": 7.47301, "grad_norm": 1.5723, "learning_rate": 0.00045, "epoch": 0.0980392,
                         "eval_runtime": 1.9})
    assert line == "step 5: loss 7.4730, grad norm 1.572, lr 4.50e-04, epoch 0.10"
