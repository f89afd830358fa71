"""The small files tests write and the disks they write on: the fixed conversations a training learns, the prompts
an inference answers, and a private tmpfs that fills up."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FIXED = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("你好，请介绍一下你自己。", "我是一个乐于助人的助手。"),
    ("Add 2 and 3.", "2 + 3 = 5."),
    ("Name a primary colour.", "Red is a primary colour."),
]


def write_fixed(path):
    """FIXED as GLM conversations, one a line."""
    return write_jsonl(
        path, [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FIXED]
    )


PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己"}]},
    {"messages": [{"role": "user", "content": "Add 2 and 3."}]},
]


def metrics_rows(run_dir) -> list[dict]:
    """RUN_DIR/metrics.jsonl, one dict a line: the run's logged steps, evaluations and its closing record."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def logged_losses(run_dir) -> list[float]:
    """The training loss of every logged step, in order."""
    return [row["loss"] for row in metrics_rows(run_dir) if "loss" in row]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def run_in_tmpfs(script: str, size: str = "3m", timeout: int = 600) -> subprocess.CompletedProcess:
    """`script` (sh) in a private mount namespace where $DISK is a fresh tmpfs of `size`."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare for a private tmpfs")
    disk = Path(os.environ.get("TMPDIR", "/tmp")) / f"glmtune-tmpfs-{os.getpid()}"
    disk.mkdir(exist_ok=True)
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk}"], capture_output=True
        )
        if probe.returncode != 0:
            pytest.skip("cannot mount a tmpfs in a private mount namespace here")
        import glmtune  # the tree under test, for the processes started here

        tree = Path(glmtune.__file__).resolve().parents[1]
        env = {**os.environ, "DISK": str(disk), "PYTHONPATH": str(tree)}
        return subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {disk} && {script}"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(disk, ignore_errors=True)
