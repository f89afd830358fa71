"""The console of a default tiny run carries glmtune's own lines only: no Hydra-format log lines, no warnings
from other packages, no Python dicts, no bars but glmtune's tokenizing bar and the Trainer's progress bar; tables
are not cut when stdout is not a terminal, and wrap at 120 columns; each training line shows tokens/s and memory;
the closing lines (at most three, 120 columns) name the best adapter; a stop signal that saved its checkpoint is not
printed as an error. In a log of stdout and stderr together no bar is glued to glmtune's lines; the header names a
quantized base and says the planned peak is the plan's estimate, the probe says what it measured; a plan's table
shows every GPU it plans for; dist.nproc_per_node=N in a launch of one process is said, not ignored."""

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
from helpers import REPO

from glmtune.train.progress import step_line

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FOREIGN = (
    re.compile(r"^\[\d{4}-\d\d-\d\d"),  # Hydra's log format: INFO belongs in rank<N>.log
    re.compile(r"Warning|warn\(", re.I),
    re.compile(r"^\{'"),
    re.compile(r"Saving the dataset"),
    re.compile(r"^\[rank\d"),
    re.compile(r"Traceback"),
)
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
    closing = out[out.index("\ndone in ") + 1 :].strip().splitlines()
    # three lines; this run dir's long path wraps the adapters' line onto a fourth, a path never split
    assert 3 <= len(closing) <= 4 and max(map(len, closing)) <= 120, closing
    assert "adapter saved to" in closing[2] and "adapter_best/" in " ".join(closing[2:])


def test_step_lines_are_short_and_readable():
    line = step_line(
        5, {"loss": 7.47301, "grad_norm": 1.5723, "learning_rate": 0.00045, "epoch": 0.0980392, "eval_runtime": 1.9}
    )
    assert line == "step 5: loss 7.4730, grad norm 1.572, lr 4.50e-04, epoch 0.10"


def test_each_training_line_shows_tokens_per_s_and_the_interval_s_memory_peak(trained):
    """The rate is the logging interval's tokens over its steps' own seconds (so at least its tokens over the
    whole run's runtime); the memory is the interval's peak that metrics.jsonl and the trackers carry (on CPU the
    process's peak resident set)."""
    rows = {
        r["step"]: r
        for r in map(json.loads, (trained.with_probe / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
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
        code = subprocess.run(
            [sys.executable, "-m", "glmtune", "mode=plan", *overrides],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        ).returncode
    text = log.read_text()
    assert code == (0 if overrides[1] == "+hw=a100_40g" else 3), text[-3000:]
    assert max(map(len, text.splitlines())) <= 120, max(text.splitlines(), key=len)
    assert "memory plan:" in text and "…" not in text  # the table is there, wrapped rather than cut
    if code == 3:
        options = re.findall(r"^  \d\. (\S+)", text, re.M)
        error = text.strip().splitlines()[-1]
        assert error.startswith("glmtune: error: the plan does not fit: ")
        # the best option's overrides are named where the line stays within 120 columns
        assert (
            (
                f"best: {options[0].rstrip(':')} ({len(options)} options listed above)" in error
                or f"{len(options)} option(s) that fit are listed above" in error
            )
            if options
            else "no option fits: lower lora.r" in error
        ), error
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
    args = [
        "+hw=a100_40g",
        "train.max_steps=500",
        "train.logging_steps=1",
        "probe.enabled=false",
        "data.val_file=null",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "glmtune", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and '"loss"' in (run / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 7, err[-3000:]
    assert "glmtune: error" not in err and "Traceback" not in err and "Warning" not in err, err[-3000:]
    (line,) = [line[line.index("glmtune: ") :] for line in err.splitlines() if "glmtune: stopped" in line]
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
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
            "`pip install kernels` and the kernels >= 0.11.1",
            ModuleNotFoundError("No module 'kernels'"),
        )
        logger.warning("an unrelated warning")
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
    assert shown.getvalue() == "an unrelated warning\n"
    assert "gemm_4bit_forward" in kept.getvalue() and "an unrelated warning" in kept.getvalue()


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One QLoRA training (nf4, a card preset, evaluations at steps 1 and 2) with stdout and stderr written to one
    file, as `cmd > log 2>&1`, SLURM and CI keep them: (the log's text, the run dir)."""
    tmp = tmp_path_factory.mktemp("logged")
    run, log = tmp / "run", tmp / "run.log"
    with log.open("w") as out:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "glmtune",
                "model.quantize=nf4",
                "+hw=a100_40g",
                "train.max_steps=2",
                "train.eval_steps=1",
                "train.logging_steps=1",
                f"hydra.run.dir={run}",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode
    text = log.read_bytes().decode()  # not read_text: its universal newlines would turn each \r into a line end
    assert code == 0, text[-3000:]
    return text, run


def test_in_a_log_of_stdout_and_stderr_no_bar_is_glued_to_glmtune_s_lines(logged):
    """The Trainer's bars update with carriage returns on a line of their own; the evaluation bar is not nested
    (no cursor-up moves, which a file keeps as bytes) and every line glmtune prints starts a line."""
    text, _ = logged
    lines = text.split("\n")
    ours = [line for line in lines if re.search(r"step \d+: |done in \d+ s", line)]
    assert len([line for line in ours if ": eval loss " in line]) == 2 and any(": loss " in line for line in ours)
    glued = [line for line in ours if not re.match(r"(step \d+: |done in )", line)]
    assert glued == [], glued
    assert "\x1b[A" not in text  # a nested bar's cursor-up move
    assert any(re.match(r"\r\s*\d+%\|", line) for line in lines)  # the bars are still there, on their own lines


def test_the_header_names_nf4_and_the_peaks_say_what_each_is(logged):
    text, run = logged
    planned = json.loads((run / "plan.json").read_text())["peak_bytes"] / 2**30
    measured = json.loads((run / "probe.json").read_text())["measured_peak_bytes"] / 2**30
    flat = " ".join(text.split())  # the header and the probe's line wrap at 120 columns
    assert "model glm4_tiny (built-in random tiny model), base weights in nf4 (bitsandbytes, double quant)" in flat
    assert f"planned peak {planned:.2f} GiB per GPU (estimate)" in flat
    assert f"probe measured peak {measured:.2f} GiB (live tensors on CPU)" in flat
    assert (
        f"the planned peak {planned:.2f} GiB per GPU adds what only a GPU holds (CUDA context, cuBLAS "
        "workspaces, allocator reserve)"
    ) in flat
    assert "estimated peak" not in flat


def test_the_closing_lines_keep_every_fact_within_120_columns(logged):
    text, run = logged
    closing = text[text.index("\ndone in ") + 1 :].strip().splitlines()
    # three lines, each wrapped within 120 columns (a wrapped part is indented by 4; a path is never split)
    assert 2 <= len([line for line in closing if not line.startswith("    ")]) <= 3, closing
    assert max(map(len, closing)) <= 120, closing
    metrics = json.loads((run / "metrics.json").read_text())
    flat = " ".join(" ".join(closing).split())
    for fact in (
        f"{metrics['steps']} steps",
        f"train loss {metrics['train_loss']:.4f}",
        f"eval loss {metrics['eval_loss']:.4f}",
        "tokens/s",
        "peak ",
        "process RSS",
        f"adapter saved to {run / 'adapter'}; best eval_loss {metrics['best']['value']:.4g} at step "
        f"{metrics['best']['step']} in adapter_best/",
    ):
        assert fact in flat, (fact, closing)


def test_a_four_gpu_plan_shows_four_gpus_and_how_to_launch_them(tmp_path):
    """Four processes sharing each row: the table's world_size is the 4 GPUs planned (plan.json keeps its
    data-parallel width, 1 group, which the Trainer divides the batch by); a plain launch is told how to run it."""
    from helpers.cli import glmtune_in_process

    proc = glmtune_in_process(
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=a100_40g",
        "dist.nproc_per_node=4",
        "dist.sequence_parallel=4",
        "data.max_length=65536",
        f"hydra.run.dir={tmp_path / 'plan'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(r"│ world_size +│ +(\d+) │ ([^│]*)│", proc.stdout)
    assert row and row[1] == "4" and row[2].startswith("4 GPUs: 1 data-parallel group(s) of 4"), proc.stdout
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["choices"]["world_size"] == 1
    assert (
        "planned for 4 GPUs (dist.nproc_per_node=4): train it with scripts/torchrun.sh 4 <same overrides>"
        in proc.stdout
    )
    assert max(map(len, proc.stdout.splitlines())) <= 120


def test_training_asking_for_more_processes_than_launched_exits_2_with_the_launch_command(tmp_path):
    """A plain `python -m glmtune` is one process: mode=train with dist.nproc_per_node=2 stops before any data
    or weights load (one line, exit 2, no run dir); mode=plan plans the 2 GPUs (above); mode=probe says it
    measures this one process."""
    from helpers.cli import glmtune_in_process

    proc = glmtune_in_process("dist.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(
        "glmtune: error: dist.nproc_per_node=2 asks for 2 processes; this launch is one — "
        "run scripts/torchrun.sh 2 <same overrides>"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_a_probe_of_one_process_says_it_is_not_the_n_asked_for(monkeypatch):
    """probe.rehearse=false measures this one process: the note says so. auto (the default) rehearses rank 0 of
    the 4 here (probe/rehearse.py), so there is nothing to say."""
    from helpers.cli import composed

    from glmtune.config import parse_config
    from glmtune.modes.launched import launch_note

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch_note(parse_config(composed(["mode=probe", "dist.nproc_per_node=4"]))) is None
    probe = parse_config(composed(["mode=probe", "dist.nproc_per_node=4", "probe.rehearse=false"]))
    assert " ".join(launch_note(probe).split()) == (
        "the probe measures this one process, not the 4 of dist.nproc_per_node=4: probe "
        "those with scripts/torchrun.sh 4 <same overrides> mode=probe"
    )
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun: the processes are there, nothing to say
    assert launch_note(probe) is None
    assert launch_note(parse_config(composed(["mode=infer", "infer.prompt=hi", "dist.nproc_per_node=4"]))) is None
