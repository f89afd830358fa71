"""train.report_to: TensorBoard, W&B (offline), MLflow (a local SQLite store) and SwanLab (local mode) each get the
run's losses and the memory figures (the plan's predicted peak, the probe's measured peak, each logging
interval's measured peak) at their step, read back from what each tracker wrote; and each holds one run for the
launch, named like the run dir, with glmtune's settings as parameters (lora.r, the plan's choices and estimate,
the probe's peak) and the final evaluation in that same run. A real CLI run in a subprocess: the trackers keep
global state (wandb.run, mlflow's active run) that must not outlive it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO
from helpers.cli import glmtune_in_process

from glmtune.config.units import GIB

MEMORY = ("memory/planned_peak_gib", "memory/probe_peak_gib", "memory/step_peak_gib")


def leveldb_records(path: Path, header: int = 7, block: int = 32768) -> list[bytes]:
    """The records of a W&B or SwanLab run file: LevelDB's log format (32 KiB blocks; each fragment has a
    4-byte CRC, a 2-byte length and a type: 1 whole, 2 first, 3 middle, 4 last) after a 7-byte file header."""
    data, pos, out, parts = path.read_bytes(), header, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # a block's zero-filled tail
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = chunk
        else:
            parts += chunk
        if kind in (1, 4):
            out.append(parts)
    return out


def wandb_records(run_file: Path, kind: str) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for data in leveldb_records(run_file):
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == kind:
            out.append(getattr(record, kind))
    return out


def wandb_history(run_file: Path) -> list[dict]:
    return [
        {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in history.item}
        for history in wandb_records(run_file, "history")
    ]


# The launch's own settings every tracker must hold (the command line set lora.r=6; the rest are defaults).
PARAMS = {
    "lora.r": 6,
    "lora.alpha": 32,
    "lora.target_modules": "query_key_value",
    "model.name": "glm4_tiny",
    "data.train_file": "data/samples/train.jsonl",
    "plan.micro_batch_size": 1,
    "plan.dtype": "fp32",
}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "SWANLAB_MODE": "local",
        "SWANLAB_LOG_DIR": str(tmp / "swanlab"),
    }
    run = tmp / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glmtune",
            "train.report_to=[tensorboard,wandb,mlflow,swanlab]",
            "train.max_steps=4",
            "train.logging_steps=2",
            "lora.r=6",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    probe = json.loads((run / "probe.json").read_text())
    expected = {
        "memory/planned_peak_gib": json.loads((run / "plan.json").read_text())["peak_bytes"] / GIB,
        "memory/probe_peak_gib": probe["measured_peak_bytes"] / GIB,
    }
    assert json.loads((run / "metrics.json").read_text())["eval_loss"] > 0  # the launch evaluated at its end
    return tmp, run, expected


def _check_params(params: dict, expected: dict) -> None:
    """params as the tracker returns them (MLflow: strings; W&B: JSON values)."""
    for key, value in PARAMS.items():
        assert str(params[key]).lower() == str(value).lower(), (key, params.get(key))
    assert float(params["plan.peak_gib"]) == pytest.approx(expected["memory/planned_peak_gib"], abs=1e-4)
    assert float(params["probe.peak_gib"]) == pytest.approx(expected["memory/probe_peak_gib"], abs=1e-4)


def _check(series: dict[str, dict[int, float]], expected: dict[str, float]) -> None:
    """series: key -> {step: value}, for the keys as glmtune named them."""
    for key, value in expected.items():
        assert series[key] and all(v == pytest.approx(value, rel=1e-6) for v in series[key].values()), key
    assert sorted(series["memory/step_peak_gib"]) == [2, 4] and min(series["memory/step_peak_gib"].values()) > 0
    assert sorted(series["loss"]) == [2, 4]


def test_tensorboard_gets_the_plan_s_and_the_probe_s_peak(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, expected = tracked
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    series = {k: {e.step: e.value for e in acc.Scalars(f"train/{k}")} for k in (*MEMORY, "loss")}
    _check(series, expected)
    assert [e.step for e in acc.Scalars("eval/loss")] == [4]  # the final evaluation, in the same folder


def test_tensorboard_s_hparams_tab_gets_glmtune_s_settings(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _, run, expected = tracked
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    (start,) = [
        c
        for c in acc.PluginTagToContent("hparams").values()
        if plugin_data_pb2.HParamsPluginData.FromString(c).HasField("session_start_info")
    ]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()}
    _check_params({k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in values.items()}, expected)


def test_wandb_offline_gets_them(tracked):
    tmp, _, expected = tracked
    (run_file,) = tmp.glob("wandb/offline-run-*/run-*.wandb")  # one run for the launch
    series: dict[str, dict[int, float]] = {}
    for row in wandb_history(run_file):  # the W&B callback prefixes train/ and logs the step as a value
        for key in (*MEMORY, "loss"):
            if f"train/{key}" in row:
                series.setdefault(key, {})[row["train/global_step"]] = row[f"train/{key}"]
    _check(series, expected)


def test_wandb_offline_holds_one_named_run_with_glmtune_s_settings_and_the_evaluation(tracked):
    tmp, _, expected = tracked
    (run_file,) = tmp.glob("wandb/offline-run-*/run-*.wandb")
    (run,) = wandb_records(run_file, "run")
    assert run.display_name == "run" and run.project == "glmtune"  # hydra.run.dir=<cwd>/run
    _check_params({u.key: json.loads(u.value_json) for u in run.config.update}, expected)
    evals = [row for row in wandb_history(run_file) if "eval/loss" in row]
    assert [row["train/global_step"] for row in evals] == [4]
    assert [e.exit_code for e in wandb_records(run_file, "exit")] == [0]


def test_mlflow_gets_them(tracked):
    from mlflow.tracking import MlflowClient

    tmp, _, expected = tracked
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    series = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in (*MEMORY, "loss")}
    _check(series, expected)
    assert run.data.params["per_device_train_batch_size"] == "1"  # the plan's choices, as the Trainer's arguments


def test_mlflow_holds_one_named_run_with_glmtune_s_settings_and_the_evaluation(tracked):
    from mlflow.tracking import MlflowClient

    tmp, _, expected = tracked
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # training and evaluation
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    _check_params(run.data.params, expected)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [4]


def test_swanlab_local_gets_them(tracked):
    tmp, _, _ = tracked
    (run_file,) = tmp.glob("swanlab/run-*/run-*.swanlab")  # one run for the launch
    text = b"".join(leveldb_records(run_file))
    assert all(key.encode() in text for key in (*MEMORY, "eval/loss"))
    config = yaml.safe_load((run_file.parent / "files" / "config.yaml").read_text())
    assert config["lora.r"]["value"] == 6 and config["plan.micro_batch_size"]["value"] == 1, config.get("lora.r")


def test_an_mlflow_file_store_that_mlflow_refuses_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path}/mlruns")
    proc = glmtune_in_process("train.report_to=[mlflow]", f"hydra.run.dir={tmp_path}/run", cwd=REPO)
    assert proc.returncode == 2 and "MLFLOW_ALLOW_FILE_STORE=true" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_launches_in_one_process_are_one_run_each_closed_with_their_outcome(tracked, tmp_path, monkeypatch):
    """An in-process sweep runs trials one after another: each launch is its own MLflow run, named after its run
    dir, and a stop signal's launch is closed KILLED, a crash's FAILED (the real TrackerRuns and MLflow store: a
    copy of the CLI run's SQLite store, whose schema is already built, with an experiment of its own)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from glmtune.train.guard import StoppedBySignal
    from glmtune.train.tracking import TrackerRuns

    shutil.copy(tracked[0] / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "in-process")
    monkeypatch.chdir(tmp_path)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with TrackerRuns(["mlflow"], tmp_path / "sweep" / "0", {"lora.r": 4, "run_dir": "x" * 10_000}):
            mlflow.log_metric("eval_loss", 1.5, step=3)
        with pytest.raises(StoppedBySignal), TrackerRuns(["mlflow"], tmp_path / "sweep" / "1", {"lora.r": 8}):
            raise StoppedBySignal(2, "SIGTERM")
        with pytest.raises(RuntimeError), TrackerRuns(["mlflow"], tmp_path / "sweep" / "2", {"lora.r": 16}):
            raise RuntimeError("a crash")
        with TrackerRuns(["mlflow"], tmp_path / "sweep" / "3", {"lora.r": 32}, active=False):  # another rank
            assert mlflow.active_run() is None
    finally:
        mlflow.set_tracking_uri(previous)
    client = MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("in-process").experiment_id])}
    assert {name: (r.info.status, r.data.params["lora.r"]) for name, r in runs.items()} == {
        "sweep/0": ("FINISHED", "4"),
        "sweep/1": ("KILLED", "8"),
        "sweep/2": ("FAILED", "16"),
    }
    assert runs["sweep/0"].data.metrics == {"eval_loss": 1.5} and len(runs["sweep/0"].data.params["run_dir"]) < 10_000
