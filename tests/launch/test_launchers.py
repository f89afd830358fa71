"""The launch scripts (scripts/*.sh under glmtune.supervise) end like one process does: a rank's documented exit
code and its one line, printed once, with no launcher report; and they run from the python they are given
(PYTHON=<venv>/bin/python without the venv on PATH, as SLURM scripts often do)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

BARE_PATH = "/usr/bin:/bin"  # no venv: torchrun and deepspeed are not on it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str, *args: str, cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": BARE_PATH,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "MASTER_PORT": str(free_port()),
        **extra_env,
    }
    return subprocess.run(
        [str(REPO / "scripts" / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def console(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("launch", [("torchrun.sh", "2"), ("deepspeed_launch.sh",)], ids=["torchrun", "deepspeed"])
def test_a_bad_value_through_a_launch_script_exits_2_with_its_line_once(tmp_path, launch):
    proc = script(*launch, "train.learning_rate=nan", cwd=tmp_path, NUM_GPUS="2")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Nothing else: not the line per rank, not torchrun's ChildFailedError block, not the launcher's exit line.
    assert console(proc) == ["glmtune: error: invalid config: train.learning_rate must be a finite number, got nan"]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.log"))


@pytest.mark.slow
def test_a_plan_that_does_not_fit_through_torchrun_sh_exits_3_with_its_line_once(tmp_path):
    proc = script(
        "torchrun.sh", "2", "mode=plan", "model=glm4_9b_chat", "+hw=t4_16g", "data.max_length=131072", cwd=tmp_path
    )
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glmtune: error: ")]
    assert len(errors) == 1 and "the plan does not fit" in errors[0], proc.stderr[-3000:]


def test_a_launcher_that_cannot_be_found_is_one_line(tmp_path):
    env = {**os.environ, "PATH": BARE_PATH, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "glmtune.supervise", "no-such-launcher", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"glmtune: error: launcher 'no-such-launcher' not found on PATH ({BARE_PATH})"
    ]


@pytest.mark.parametrize(
    "path",
    [
        "torch/distributed",
        ".venv/lib/python3.11/site-packages/torch/distributed",
        "/opt/conda/lib/python3.11/site-packages/torch/distributed",
    ],
)
def test_torchrun_agent_lines_after_a_rank_line_are_dropped_whatever_the_path(tmp_path, path):
    """torch prints its agent's path shortened against sys.path: with a venv inside the repo and the repo on
    PYTHONPATH it starts ".venv/lib/..." (what CI printed). After a rank's own line each form is dropped."""
    agent = f"W1126 10:38:31.733000 17130 {path}/elastic/multiprocessing/api.py:1028] Sending process 1 closing signal"
    launcher = f"echo 'glmtune: error: bad' >&2; echo '{agent}' >&2; echo 'glmtune: error: bad' >&2; exit 1"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "glmtune.supervise", "sh", "-c", launcher],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert console(proc) == ["glmtune: error: bad"]


def test_help_shows_the_launch_script_and_what_plain_torchrun_does():
    from glmtune.config.cli import wants_info

    text = wants_info(["--help"])
    assert "scripts/torchrun.sh 4 +hw=" in text
    examples = text.split("examples:")[1].split("exit codes:")[0]
    assert "torchrun --nproc_per_node" not in examples  # the example is the script, which keeps the exit codes
    assert "Plain `torchrun -m glmtune`" in text and "SignalException" in text


@pytest.mark.slow
def test_sigterm_while_the_ranks_start_is_exit_7_and_one_line(tmp_path):
    """The signal reaches the ranks while they import (SIGTERM kills them there) or just after glmtune took the
    signals over: either way nothing is saved, the script exits 7 with one line, no traceback."""
    import signal
    import time

    from glmtune.launch.supervise import descendants, is_rank

    env = {**os.environ, "PATH": BARE_PATH, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [str(REPO / "scripts" / "torchrun.sh"), "2", "train.max_steps=2"],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while len([pid for pid in descendants(proc.pid) if is_rank(pid)]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "stopped by SIGTERM before training began" in lines[0], err[-3000:]
