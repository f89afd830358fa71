"""The console of a default tiny run carries glmtune's own lines only: no Hydra-format log lines, no warnings
from other packages, no Python dicts, no bars but glmtune's tokenizing bar and the Trainer's progress bar; tables
are not cut when stdout is not a terminal, and wrap at 120 columns; each training line shows tokens/s and memory;
the closing line names the best adapter; a stop signal that saved its checkpoint is not printed as an error."""
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
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


def test_each_training_line_shows_tokens_per_s_and_the_interval_s_memory_peak(trained):
    """The rate is the logging interval's tokens over its steps' own seconds (so at least its tokens over the
    whole run's runtime); the memory is the interval's peak that metrics.jsonl and the trackers carry (on CPU the
    process's peak resident set)."""
    rows = {r["step"]: r for r in map(json.loads, (trained.with_probe / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    runtime = json.loads((trained.with_probe / "metrics.json").read_text())["runtime_s"]
    lines = [line for line in trained.proc.stdout.splitlines() if re.match(r"step \d+: loss ", line)]
    assert len(lines) == len(rows) == 6, lines
    seen = 0
    for line in lines:
        match = re.fullmatch(r"step (\d+): loss .*, ([\d,]+) tokens/s, peak RSS ([\d.]+) GiB", line)
        assert match, line
        row = rows[int(match[1])]
        assert float(match[3]) == pytest.approx(row["memory/step_peak_gib"], abs=0.005) and float(match[3]) > 0.1
        assert int(match[2].replace(",", "")) >= (row["num_input_tokens_seen"] - seen) / runtime > 0, line
        seen = row["num_input_tokens_seen"]


PLANS = [  # a plan that fits, one whose options combine levers, one with nothing to offer
    ["model=glm4_9b_chat", "+hw=a100_40g"],
    ["model=glm4_9b_chat", "+hw=t4_16g", "data.max_length=131072"],
    ["model=glm4_9b_chat", "+hw=t4_16g", "data.max_length=1048576", "lora=all_linear", "lora.r=1024"],
]


@pytest.mark.parametrize("overrides", PLANS, ids=lambda o: " ".join(o[1:]))
def test_a_plan_logged_to_a_file_has_no_line_over_120_columns(tmp_path, overrides):
    log = tmp_path / "plan.log"
    with log.open("w") as out:  # stdout and stderr to one file, as SLURM and CI keep them
        code = subprocess.run([sys.executable, "-m", "glmtune", "mode=plan", *overrides], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text()
    assert code == (0 if overrides[1] == "+hw=a100_40g" else 3), text[-3000:]
    assert max(map(len, text.splitlines())) <= 120, max(text.splitlines(), key=len)
    assert "memory plan:" in text and "…" not in text  # the table is there, wrapped rather than cut
    if code == 3:
        options = re.findall(r"^  \d\. (\S+)", text, re.M)
        error = text.strip().splitlines()[-1]
        assert error.startswith("glmtune: error: the plan does not fit: ")
        # the best option's overrides are named where the line stays within 120 columns
        assert ((f"best: {options[0].rstrip(':')} ({len(options)} options listed above)" in error
                 or f"{len(options)} option(s) that fit are listed above" in error) if options
                else "no option fits: lower lora.r" in error), error
        assert bool(options) == ("lora.r=1024" not in overrides), options  # 2.7e9 LoRA parameters: nothing helps
        if "data.max_length=131072" in overrides:  # the bf16 weights alone exceed a T4: only combinations help
            # (more GPUs sharing each row under ZeRO-3, or a quantized base with shorter examples)
            lines = [line for line in re.findall(r"^  \d\. (.*)$", text, re.M) if not line.startswith("dist.")]
            assert lines[0].startswith("model.quantize=nf4 data.max_length="), lines


@pytest.mark.slow
def test_a_stop_signal_that_saved_its_checkpoint_says_stopped_not_error(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    # +hw= on CPU: bf16 autocast, whose torch.cpu.amp.autocast FutureWarning the Trainer would print twice
    args = ["+hw=a100_40g", "train.max_steps=500", "train.logging_steps=1", "probe.enabled=false", "data.val_file=null",
            f"hydra.run.dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "glmtune", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and '"loss"' in (run / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 7, err[-3000:]
    assert "glmtune: error" not in err and "Traceback" not in err and "Warning" not in err, err[-3000:]
    (line,) = [line[line.index("glmtune: "):] for line in err.splitlines() if "glmtune: stopped" in line]
    assert re.match(r"glmtune: stopped by SIGTERM at step \d+: ", line) and "re-run the same command" in line
    assert json.loads((run / "run_state.json").read_text())["status"] == "interrupted"


def test_bitsandbytes_kernels_notice_reaches_the_rank_log_not_the_console():
    """bitsandbytes warns at import on CPUs with AVX512-BF16 (not this machine's); its logger's record, as bitsandbytes
    emits it, goes to an INFO handler (the rank log) and not to a WARNING one (the console)."""
    from glmtune.launch.quiet import quiet_libraries

    quiet_libraries()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    shown, kept = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(shown), logging.StreamHandler(kept)]
    handlers[0].setLevel(logging.WARNING)
    handlers[1].setLevel(logging.INFO)
    for handler in handlers:
        logger.addHandler(handler)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                       "`pip install kernels` and the kernels >= 0.11.1", ModuleNotFoundError("No module 'kernels'"))
        logger.warning("an unrelated warning")
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
    assert shown.getvalue() == "an unrelated warning\n"
    assert "gemm_4bit_forward" in kept.getvalue() and "an unrelated warning" in kept.getvalue()
