"""Sweeps: a multirun records every trial (failed ones too) and writes a summary; optuna and SLURM presets."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

HAS_OPTUNA = importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
HAS_SUBMITIT = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None


def multirun(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "glmtune", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )


def trials(sweep_dir):
    return [json.loads(line) for line in (sweep_dir / "trials.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grid_sweep_records_a_failed_trial_and_finishes_the_others(tmp_path, repo):
    proc = multirun(
        "-m",
        "lora.target_modules=[query_key_value],[no_such_layer],[dense]",
        "train.max_steps=2",
        "probe.enabled=false",
        f"hydra.sweep.dir={tmp_path}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(trials(tmp_path), key=lambda r: r["num"])
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert "no_such_layer" in rows[1]["error"] and math.isnan(rows[1]["metric"])
    for row in (rows[0], rows[2]):
        assert row["fits"] and row["planned_peak_bytes"] > 0 and row["train_loss"] > 0
        assert (tmp_path / str(row["num"]) / "adapter" / "adapter_model.safetensors").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "3 trials, 1 failed" in summary and summary.count("| ok |") == 2 and "| failed |" in summary
    assert "lora.target_modules=[dense]" in summary and "best: trial" in summary
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("sweep done: 3 trials, 1 failed or not fitting") and "; best: trial " in last


def test_plan_sweep_records_a_trial_that_does_not_fit(tmp_path, repo):
    from helpers.cli import glmtune_in_process  # a multirun of plans: Hydra's basic launcher, in this process

    proc = glmtune_in_process(
        "-m",
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=rtx4090_24g",
        "data.max_length=512,131072",
        f"hydra.sweep.dir={tmp_path}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(trials(tmp_path), key=lambda r: r["num"])
    assert [r["status"] for r in rows] == ["ok", "does not fit"] and rows[1]["exit_code"] == 3
    assert rows[1]["fits"] is False and "data.max_length=" in rows[1]["error"]  # the plan's advice
    assert "| does not fit | no |" in (tmp_path / "summary.md").read_text()
    # each trial says where the table is; the sweep ends on the best trial
    assert (
        proc.stdout.count(f"(table: {tmp_path / 'summary.md'}; one line per trial: {tmp_path / 'trials.jsonl'})") == 2
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"sweep done: 2 trials, 1 failed or not fitting; summary {tmp_path / 'summary.md'}")
    assert last.endswith("no trial has a loss (none trained, or all failed)")  # plans train nothing


@pytest.mark.slow
@pytest.mark.skipif(not HAS_OPTUNA, reason="hydra-optuna-sweeper not installed (pip install -e '.[sweep]')")
def test_optuna_preset_runs_trials_and_summarises(tmp_path, repo):
    proc = multirun(
        "+hparams_search=lora_optuna",
        "hydra.sweeper.n_trials=2",
        "train.max_steps=2",
        "probe.enabled=false",
        f"hydra.sweep.dir={tmp_path}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = trials(tmp_path)
    assert len(rows) == 2 and all(r["status"] == "ok" and r["metric"] > 0 for r in rows)
    assert all(any(o.startswith("lora.r=") for o in r["overrides"]) for r in rows)  # optuna chose them
    assert "Best parameters" in proc.stdout + proc.stderr or (tmp_path / "optimization_results.yaml").exists()


@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
def test_slurm_preset_submission(tmp_path, repo, monkeypatch):
    import submitit

    from glmtune.config import CONF_DIR  # conf/ at the top of a checkout, glmtune/conf in a wheel

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            "config",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.nodes=2",
                "hydra.launcher.gpus_per_node=4",
                "hydra.launcher.partition=gpu",
                f"hydra.sweep.dir={tmp_path}",
            ],
        )
    HydraConfig.instance().set_config(cfg)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    submitted = {}

    def capture(executor, fn, *job_args):  # stands in for sbatch: keep what would be submitted
        submitted.update(executor=executor, fn=fn, job_args=job_args)
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    # No SLURM here: submitit looks for srun before it builds a SLURM executor.
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    launcher.launch([["lora.r=8"], ["lora.r=16"]], initial_job_idx=0)
    params = submitted["executor"]._executor.parameters
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 4 and params["gpus_per_node"] == 4
    assert params["partition"] == "gpu" and params["time"] == 240
    assert submitted["job_args"][0] == (["lora.r=8"], ["lora.r=16"])  # one array task per trial
    script = submitted["executor"]._executor._make_submission_file_text("python -m glmtune", "0")
    for flag in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu", "--time=240"):
        assert f"#SBATCH {flag}" in script, script
    assert "srun" in script and "torchrun" not in script


@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
def test_slurm_task_exports_the_torch_distributed_env(repo):
    # Task 5 of 8 (2 nodes x 4), as srun starts it: SLURM's variables only, no RANK.
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    }
    code = (
        "import json, os; from glmtune.launch import export_slurm_env; done = export_slurm_env(); "
        "print(json.dumps([done, {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
        "'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'CUDA_VISIBLE_DEVICES')}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env={**clean, **slurm}, capture_output=True, text=True, check=True
    ).stdout
    done, exported = json.loads(out)
    assert done and exported == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "24242",
        "CUDA_VISIBLE_DEVICES": None,
    }
    # Under torchrun (RANK already set) it leaves the environment alone.
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        env={**clean, **slurm, "RANK": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)[0] is False


def test_a_multirun_in_which_every_trial_fails_exits_9(tmp_path, repo):
    proc = multirun(
        "-m",
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=t4_16g",
        "data.max_length=65536,131072",
        f"hydra.sweep.dir={tmp_path}",
        cwd=repo,
    )
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [r["status"] for r in trials(tmp_path)] == ["does not fit", "does not fit"]
    assert proc.stdout.strip().splitlines()[-1].startswith("sweep done: 2 trials, 2 failed or not fitting")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_OPTUNA, reason="hydra-optuna-sweeper not installed (pip install -e '.[sweep]')")
def test_an_optuna_sweep_in_which_every_trial_fails_says_so_in_glmtunes_words_only(tmp_path, repo):
    proc = multirun(
        "+hparams_search=lora_optuna",
        "hydra.sweeper.n_trials=2",
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=t4_16g",
        "data.max_length=131072",
        f"hydra.sweep.dir={tmp_path}",
        cwd=repo,
    )
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert "float-castable" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert [r["status"] for r in trials(tmp_path)] == ["does not fit", "does not fit"]
    assert proc.stdout.strip().splitlines()[-1].startswith("sweep done: 2 trials, 2 failed or not fitting")


# The preset's search space plus a precision the CPU cannot train (fp16); the sampler is seeded, so which trials
# draw it is fixed. The study must record the failure and go on to the next trial.
@pytest.mark.slow
@pytest.mark.skipif(not HAS_OPTUNA, reason="hydra-optuna-sweeper not installed (pip install -e '.[sweep]')")
def test_optuna_study_goes_on_after_a_failed_trial_and_a_rerun_does_not_repeat_finished_trials(tmp_path, repo):
    sweep = tmp_path / "sweep"
    args = (
        "+hparams_search=lora_optuna",
        "hydra.sweeper.n_trials=3",
        '+hydra.sweeper.params={train.precision:"choice(fp32,fp16)"}',
        "train.max_steps=2",
        "probe.enabled=false",
        "data.val_file=null",
        f"hydra.sweep.dir={sweep}",
    )
    proc = multirun(*args, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = trials(sweep)
    assert len(rows) == 3 and {r["status"] for r in rows} == {"ok", "failed"}, rows
    for row in rows:
        assert ("train.precision=fp16" in row["overrides"]) == (row["status"] == "failed")
    last = proc.stdout.strip().splitlines()[-1]
    best = min((r for r in rows if r["status"] == "ok"), key=lambda r: r["metric"])
    assert f"run dir {best['run_dir']}, adapter {best['adapter']}" in last and best["adapter"].endswith("adapter")

    again = multirun(*args, cwd=repo)  # the same sweep dir: finished trials are not trained again
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("ok before") == sum(r["status"] == "ok" for r in rows)
    assert len(trials(sweep)) == 3 + sum(r["status"] != "ok" for r in rows)  # only the failed one ran again


def _submitit_task(root: int) -> int | None:
    """The pid of submitit's task process (`python -u -m submitit.core._submit FOLDER`) below `root`, if started."""
    from glmtune.launch.supervise import descendants

    for pid in descendants(root):
        try:
            if b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
def test_a_submitit_job_signalled_before_its_time_limit_saves_is_requeued_and_resumes(tmp_path, repo):
    """The SLURM launcher's time-limit path, run by submitit's local executor (the same job environment, signal
    handler and requeue, without SLURM). The test sends the task submitit's signal (SIGUSR2) once training has
    logged, as SLURM does `signal_delay_s` before the limit: glmtune finishes the step and writes a checkpoint,
    submitit's handler resubmits the job, and the requeued job resumes in the same trial dir and finishes."""
    steps, sweep = 400, tmp_path / "sweep"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "glmtune",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=10",
            f"train.max_steps={steps}",
            "data.val_file=null",
            "probe.enabled=false",
            "train.logging_steps=20",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    metrics, deadline = sweep / "0" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):  # training has begun and logged a step
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    os.kill(_submitit_task(proc.pid), signal.SIGUSR2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))
    assert "Requeued job" in logs and "submitit requeues the job" in logs, logs[-3000:]
    stopped = int(logs.split("stopped by SIGUSR2 at step ")[1].split(":")[0])
    assert 0 < stopped < steps
    assert f"resuming from {sweep / '0' / 'checkpoints' / f'checkpoint-{stopped}'}" in logs
    (trial,) = trials(sweep)
    assert trial["status"] == "ok" and trial["run_dir"] == str(sweep / "0")
    state = json.loads((sweep / "0" / "run_state.json").read_text())
    assert state["status"] == "done" and state["step"] == steps
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert logged == list(range(20, steps + 1, 20))  # every interval once: the resume trimmed nothing twice
    assert out.strip().splitlines()[-1].startswith("sweep done: 1 trials, 0 failed")  # the launching process


@pytest.mark.slow
@pytest.mark.skipif(not HAS_OPTUNA, reason="hydra-optuna-sweeper not installed (pip install -e '.[sweep]')")
def test_sigterm_during_an_optuna_trial_stops_the_sweep_and_the_same_command_continues_it(tmp_path, repo):
    """4 trials; SIGTERM while trial 1 trains: that trial saves and is recorded `stopped`, trial 2 never starts,
    exit 7 with one line. The same command (no hydra.sweep.dir: Hydra names a fresh one each launch) then finds
    the stopped sweep, keeps trial 0, resumes trial 1 from its checkpoint and runs trials 2 and 3."""
    cmd = [
        sys.executable,
        "-m",
        "glmtune",
        "+hparams_search=lora_optuna",
        "hydra.sweeper.n_trials=4",
        "train.max_steps=30",
        "train.logging_steps=1",
        "probe.enabled=false",
        "data.val_file=null",
        f"data.train_file={repo / 'data/samples/train.jsonl'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 600
    while not any('"loss"' in m.read_text() for m in tmp_path.glob("multirun/*/*/1/metrics.jsonl")):  # trial 1 trains
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 7, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    [sweep] = [p.parent for p in tmp_path.glob("multirun/*/*/trials.jsonl")]
    lines = [line for line in err.splitlines() if "glmtune: error: " in line or "glmtune: stopped by" in line]
    assert len(lines) == 1 and "glmtune: stopped by SIGTERM at step" in lines[0], err[-3000:]
    assert "trial 1 resumes" in lines[0] and sweep.name in lines[0]
    assert [(r["num"], r["status"]) for r in trials(sweep)] == [(0, "ok"), (1, "stopped")]
    assert not (sweep / "2").exists()  # no further trial started
    stopped_at = json.loads((sweep / "1" / "run_state.json").read_text())["step"]
    assert 0 < stopped_at < 30

    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"continuing {sweep.relative_to(tmp_path)}" in again.stdout and "trial 0: ok before" in again.stdout
    resumed = [line for line in again.stdout.splitlines() if "resuming from" in line]  # trial 1 only
    assert len(resumed) == 1 and f"{sweep.name}/1/checkpoints/checkpoint-{stopped_at} " in resumed[0], resumed
    assert [p.parent for p in tmp_path.glob("multirun/*/*/trials.jsonl")] == [sweep]  # no second sweep dir
    latest = {r["num"]: r for r in trials(sweep)}
    assert sorted(latest) == [0, 1, 2, 3] and all(r["status"] == "ok" for r in latest.values()), latest
    assert json.loads((sweep / "1" / "run_state.json").read_text())["status"] == "done"
    assert not (sweep / "stopped.json").exists()
    assert again.stdout.strip().splitlines()[-1].startswith("sweep done: 4 trials, 0 failed")
