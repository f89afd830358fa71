"""Stop and resume the way the console says: the identical command line (no hydra.run.dir) resumes the
interrupted run, and the command printed at the stop, pasted into a shell as it is, resumes it too.

"Resumes" means: the run ends in the interrupted run's dir with the adapter fingerprint of an uninterrupted run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

from glmtune.models.presets import ensure_tiny

STEPS = 24
ARGS = [
    "lora=all_linear",
    "train.learning_rate=1e-2",
    f"train.max_steps={STEPS}",
    "train.logging_steps=1",
    "probe.enabled=false",
    f"data.train_file={REPO / 'data/samples/train.jsonl'}",
    "data.val_file=null",
]
# PYTHONFAULTHANDLER: a process that hangs prints every thread's stack on SIGABRT (stopped_or_stacks).
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO),
    "PYTHONFAULTHANDLER": "1",
}


def start(cmd, cwd) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=cwd, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, shell=isinstance(cmd, str)
    )


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/.hydra"))


def logged_steps(cwd: Path) -> int:
    return sum(
        sum('"loss"' in line for line in (d / "metrics.jsonl").read_text().splitlines())
        for d in run_dirs(cwd)
        if (d / "metrics.jsonl").exists()
    )


def stop_after(proc: subprocess.Popen, cwd: Path, steps: int) -> tuple[int, str, str]:
    deadline = time.monotonic() + 300
    while logged_steps(cwd) < steps:
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out waiting for logged steps"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def stop_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    # glmtune's one line: an error, or a stop that saved its checkpoint ("glmtune: stopped by ...", not an error)
    lines = [
        line[m.start() :] for line in stderr.splitlines() if (m := re.search(r"glmtune: (error: |stopped by )", line))
    ]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def fingerprint(run_dir: Path) -> str:
    return json.loads((run_dir / "metrics.json").read_text())["adapter_sha256"]


@pytest.mark.slow
def test_the_same_command_and_the_printed_command_both_resume(tmp_path):
    ensure_tiny("glm4")
    cmd = [sys.executable, "-m", "glmtune", *ARGS]
    reference = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'reference'}"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()

    code, _, err = stop_after(start(cmd, work), work, 3)  # 1. SIGTERM during training
    assert code == 7, err[-3000:]
    [first] = run_dirs(work)
    assert json.loads((first / "run_state.json").read_text())["status"] == "interrupted"

    proc = start(cmd, work)  # 2. the identical command line: it continues that run dir, and is stopped again
    code, out, err = stop_after(proc, work, 3 + 6)
    assert code == 7, err[-3000:]
    assert f"continuing {first}" in out and "resuming from" in out
    assert run_dirs(work) == [first]  # no second run dir was left behind
    line = stop_line(err)
    pasted = line.split("re-run the same command to resume from it, or: ", 1)[1]

    other = tmp_path / "elsewhere"  # 3. the printed command, pasted into a shell in another folder
    other.mkdir()
    done = subprocess.run(pasted, shell=True, cwd=other, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout
    assert fingerprint(first) == fingerprint(tmp_path / "reference")
    assert json.loads((first / "run_state.json").read_text())["status"] == "done"

    # A finished run is never picked up again: the same command now trains a new run from step 0.
    code = subprocess.run(
        [*cmd, "train.max_steps=2"], cwd=work, env=ENV, capture_output=True, text=True, timeout=600
    ).returncode
    assert code == 0 and len(run_dirs(work)) == 2


def torchrun_sh(*args) -> list[str]:
    return [str(REPO / "scripts" / "torchrun.sh"), "2", *ARGS, *args]


@pytest.mark.slow
@pytest.mark.parametrize("dist", ["ddp"])
def test_torchrun_script_stops_with_exit_7_one_line_and_the_same_command_resumes(tmp_path, dist):
    """scripts/torchrun.sh with 2 CPU ranks (gloo): SIGTERM to the script exits 7 with the stop line once and no
    traceback (rank 1 logs it to its file); the same command then resumes the run to the uninterrupted adapter.
    ZeRO-3's stop and resume under torchrun, to the same losses and adapter, is
    tests/rundir/test_durable.py::test_zero3_two_ranks_sigterm_then_resume_matches_the_uninterrupted_run (this
    test's zero3 case repeated it through the script: 2-4 min of the suite for no behaviour of its own)."""
    ensure_tiny("glm4")
    env = {**ENV, "PYTHON": sys.executable}
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        torchrun_sh(f"dist={dist}"), cwd=work, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    code, _, err = stop_after(proc, work, 3)
    assert code == 7, err[-3000:]
    line = stop_line(err)  # exactly one glmtune line, no traceback
    assert line.startswith("glmtune: stopped by SIGTERM at step ") and "torchrun --standalone" in line
    [first] = [d for d in (work / "outputs").glob("*/torchrun-*")]
    assert "stopped by SIGTERM" in (first / "rank1.log").read_text()
    assert json.loads((first / "run_state.json").read_text())["status"] == "interrupted"

    resumed = subprocess.run(
        torchrun_sh(f"dist={dist}"), cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    assert f"continuing {first}" in resumed.stdout and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = subprocess.run(
        torchrun_sh(f"dist={dist}", f"hydra.run.dir={tmp_path / 'reference'}"),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert fingerprint(first) == fingerprint(tmp_path / "reference")


@pytest.mark.slow
def test_a_changed_data_file_is_refused_on_resume_and_plan_or_probe_never_rewrite_a_training_run(tmp_path):
    ensure_tiny("glm4")
    data = tmp_path / "train.jsonl"
    data.write_bytes((REPO / "data/samples/train.jsonl").read_bytes())
    cmd = [sys.executable, "-m", "glmtune", *ARGS, f"data.train_file={data}"]
    work = tmp_path / "work"
    work.mkdir()
    code, _, err = stop_after(start(cmd, work), work, 2)
    assert code == 7, err[-3000:]
    [run_dir] = run_dirs(work)
    files = {
        p: p.read_bytes()
        for p in [
            run_dir / ".hydra/config.yaml",
            run_dir / "plan.json",
            run_dir / "versions.json",
            run_dir / "run_state.json",
        ]
    }

    # mode=plan and mode=probe into the training run's dir: refused, nothing rewritten
    for mode in ("plan", "probe"):
        proc = subprocess.run(
            [*cmd, f"mode={mode}", f"hydra.run.dir={run_dir}"],
            cwd=work,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 2 and "holds a training run" in stop_line(proc.stderr), proc.stderr[-3000:]
        assert {p: p.read_bytes() for p in files} == files

    # The data edited in place: same size, same mtime, other text (two letters swapped in the first answer).
    stat, text = data.stat(), data.read_text()
    at = text.index('"assistant", "content": "') + len('"assistant", "content": "')
    data.write_text(text[:at] + text[at + 1] + text[at] + text[at + 2 :])
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size and data.read_text() != text
    proc = subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = stop_line(proc.stderr)
    assert "cannot resume" in line and str(data) in line and "train.resume=restart" in line
    assert {p: p.read_bytes() for p in files} == files and run_dirs(work) == [run_dir]


@pytest.mark.slow
def test_a_crash_during_training_leaves_run_state_failed(tmp_path):
    """GLM-4V on copied samples; the images deleted after the first step make the collator fail mid-run."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(REPO / "data/samples_vision", data)
    run_dir = tmp_path / "run"
    proc = start(
        [
            sys.executable,
            "-m",
            "glmtune",
            "model=glm4v_tiny",
            "data=samples_vision",
            "probe.enabled=false",
            f"data.train_file={data / 'train.jsonl'}",
            "data.val_file=null",
            "train.max_steps=40",
            "train.logging_steps=1",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or '"loss"' not in (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.05)
    shutil.rmtree(data / "images")
    proc.communicate(timeout=300)
    assert proc.returncode not in (0, 7)
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "failed" and "image" in state["error"], state


@pytest.mark.slow
def test_a_corrupted_cache_entry_is_built_again_never_trained_on(tmp_path):
    ensure_tiny("glm4")
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "glmtune", *ARGS, "train.max_steps=1", f"data.cache_dir={cache}"]
    first = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'a'}"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    recorded = json.loads((entry / "meta.json").read_text())["files_sha256"]
    arrow = max((p for p in (entry / "dataset").rglob("*.arrow")), key=lambda p: p.stat().st_size)
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit flipped in the middle of the token data
    arrow.write_bytes(bytes(raw))

    second = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "is damaged" in second.stdout + second.stderr and "building it again" in second.stdout + second.stderr
    from glmtune.data.cache import damage, files_sha256

    assert damage(entry) is None and files_sha256(entry) == recorded  # the same rows as first built
    losses = [
        json.loads(line)["loss"]
        for run in ("a", "b")
        for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert losses[0] == losses[1]  # trained on the rebuilt entry, not the flipped bit


def children(pid: int) -> list[int]:
    from glmtune.launch.supervise import descendants

    return descendants(pid)


def big_data(folder: Path) -> Path:
    """30,600 conversations (the samples 600 times): a multi-process cache build of several seconds."""
    path = folder / "big.jsonl"
    path.write_bytes((REPO / "data/samples/train.jsonl").read_bytes() * 600)
    return path


def wait_for_workers(proc: subprocess.Popen, cache: Path, count: int = 2) -> list[int]:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the build never started its workers"
        workers = children(proc.pid)
        if len(workers) >= count and list(cache.glob(".big-*.tmp-*")):
            return workers
        time.sleep(0.05)


def stopped_or_stacks(proc: subprocess.Popen, timeout: float) -> str:
    """The stderr of a process that exits within `timeout` s; else fail with where each of its threads waits
    (faulthandler's dump on SIGABRT: PYTHONFAULTHANDLER is set in ENV) and which of its children still run."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        from glmtune.launch.supervise import running

        left = []
        for pid in filter(running, children(proc.pid)):
            try:
                left.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
            except OSError:
                pass  # exited meanwhile
        proc.send_signal(signal.SIGABRT)
        err = proc.communicate(timeout=30)[1]
        pytest.fail(f"no exit {timeout:.0f} s after the signal; children: {left}; stderr: {err[-6000:]}")


def gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(
            Path(f"/proc/{pid}").exists() and "(Z)" not in Path(f"/proc/{pid}/stat").read_text()
            for pid in pids
            if Path(f"/proc/{pid}").exists()
        ):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_signal_during_a_multi_process_cache_build_stops_within_seconds(tmp_path):
    ensure_tiny("glm4")
    data, cache = big_data(tmp_path), tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "glmtune",
        "mode=probe",
        f"data.train_file={data}",
        "data.val_file=null",
        "data.num_proc=2",
        f"data.cache_dir={cache}",
    ]
    for attempt, sig in enumerate([signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT, signal.SIGTERM]):
        proc = start(cmd, tmp_path)
        workers = wait_for_workers(proc, cache)
        sent = time.monotonic()
        proc.send_signal(sig)
        err = stopped_or_stacks(proc, 60)
        assert time.monotonic() - sent < 10, f"try {attempt}: {time.monotonic() - sent:.1f} s"
        assert proc.returncode == 7, f"try {attempt}: {err[-3000:]}"
        assert f"stopped by {sig.name} before training began" in stop_line(err)  # one line, no traceback
        assert gone(workers), f"try {attempt}: a worker outlived the launcher"
        assert not list(cache.glob(".big-*.tmp-*")), "the half-built entry was left behind"


@pytest.mark.slow
def test_kill_9_during_a_multi_process_cache_build_leaves_no_orphan_and_the_same_command_trains(tmp_path):
    ensure_tiny("glm4")
    data, cache = big_data(tmp_path), tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "glmtune",
        f"data.train_file={data}",
        "data.val_file=null",
        "data.num_proc=2",
        f"data.cache_dir={cache}",
        "train.max_steps=1",
        "probe.enabled=false",
    ]
    proc = start(cmd, tmp_path)
    workers = wait_for_workers(proc, cache)
    proc.kill()
    proc.communicate(timeout=60)
    assert gone(workers), "a worker outlived the launcher killed by SIGKILL"
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "waiting for another process" not in done.stdout + done.stderr


FORK_WINDOW = """
import os, signal, time
# Registered before the stop handler's own hook, so it runs first in the child: a SIGTERM that lands between the
# fork and the child's reset of the handler (a parent stopping its children at that moment).
os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))
from glmtune.launch.signals import STOP
STOP.install()
pid = os.fork()
if pid == 0:
    time.sleep(5)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_child_signalled_while_it_forks_dies_of_it():
    """The child of a process with the stop handler installed must die of a SIGTERM it gets at any moment: one
    that outlived it kept the parent's exit waiting (CI, stop 46: datasets' manager process, joined at exit)."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_WINDOW], env=ENV, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == [str(-signal.SIGTERM)], out.stdout + out.stderr


STRAGGLER = """
import subprocess, sys, time
from glmtune.launch.supervise import stop_descendants
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
plain = "import time; print(1, flush=True); time.sleep(60)"
children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for code in (deaf, plain)]
for child in children:
    child.stdout.readline()  # started, and SIGTERM ignored by the first
start = time.monotonic()
stop_descendants(grace_s=1.0)
print([child.wait(timeout=10) for child in children], round(time.monotonic() - start, 1))
"""


def test_stopping_the_children_kills_one_that_ignores_sigterm():
    out = subprocess.run(
        [sys.executable, "-c", STRAGGLER], env=ENV, capture_output=True, text=True, timeout=60, check=True
    )
    codes, seconds = out.stdout.rsplit(" ", 1)
    assert codes == f"[{-signal.SIGKILL}, {-signal.SIGTERM}]", out.stdout + out.stderr
    assert 0.9 < float(seconds) < 5, out.stdout  # SIGKILL after the grace, not before
