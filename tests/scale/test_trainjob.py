"""mode=plan plan.emit=trainjob (issue 43): the Kubeflow Trainer v2 TrainJob and its ClusterTrainingRuntime, read
back through the official SDK's models (kubeflow_trainer_api); its resources per node are the plan's. The runs of
what the TrainJob runs (ranks launched with the runtime's PET_* variables, SIGTERM, progress) are in
test_scaleout.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from helpers.cli import glmtune_in_process

k = pytest.importorskip("kubeflow_trainer_api.models", reason='the kubeflow extra: pip install -e ".[kubeflow]"')

PLAN = [
    "mode=plan",
    "model=glm4_9b_chat",
    "+hw=a100_80g",
    "dist.nnodes=2",
    "dist.nproc_per_node=8",
    "plan.emit=trainjob",
]


def emitted(cwd: Path) -> list[Path]:
    return sorted(cwd.glob("outputs/*/*/trainjob.yaml"))


def loads_back(model, path: Path) -> dict:
    """The file's object read by the SDK's model and written again: the same dict (nothing dropped or renamed)."""
    data = yaml.safe_load(path.read_text())
    assert model.from_dict(data).to_dict() == data
    return data


def test_the_trainjob_asks_for_what_the_plan_needs_and_the_sdk_reads_it_back_unchanged(tmp_path):
    proc = glmtune_in_process(*PLAN, "plan.queue=team-a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [job_file] = emitted(tmp_path)
    run_dir = job_file.parent
    job = loads_back(k.TrainerV1alpha1TrainJob, job_file)
    runtime = loads_back(k.TrainerV1alpha1ClusterTrainingRuntime, run_dir / "glmtune-torch.yaml")
    plan = json.loads((run_dir / "plan.json").read_text())

    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    resources = trainer["resourcesPerNode"]
    assert resources["limits"] == {"nvidia.com/gpu": "8"} and resources["requests"]["nvidia.com/gpu"] == "8"
    assert resources["requests"]["memory"] == f"{math.ceil(plan['host']['bytes'] / 2**30)}Gi"  # the plan's host RAM
    assert int(resources["requests"]["cpu"]) >= 8
    # torchrun under glmtune's supervisor (PET_* from the runtime, exit 7 on SIGTERM), the user's overrides without
    # the planning ones, the run dir named after the TrainJob
    assert trainer["command"][:5] == ["python", "-m", "glmtune.supervise", "torchrun", "-m"]
    assert trainer["args"] == ["model=glm4_9b_chat", "+hw=a100_80g", "dist.nnodes=2", "dist.nproc_per_node=8"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["GLMTUNE_RUN_ID"] == job["metadata"]["name"] and not any(n.startswith("PET_") for n in env)
    assert job["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "glmtune-torch"
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "glmtune"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/glmtune"
    grace = pod["terminationGracePeriodSeconds"]
    assert isinstance(grace, int) and grace > 60  # Kubernetes' default is 30 s

    [replicated] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    container = replicated["template"]["spec"]["template"]["spec"]["containers"][0]
    assert (replicated["name"], container["name"], container["workingDir"]) == ("node", "node", "/glmtune")
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    said = proc.stdout.splitlines()
    assert f"  kubectl apply -f {run_dir / 'glmtune-torch.yaml'}   # once per cluster" in said
    assert f"  kubectl apply -f {job_file}" in said
    assert all(len(line) <= 120 for line in said if str(tmp_path) not in line)  # a log's width (test_console.py)

    # A longer step (32K tokens, 8 micro-batches a step) needs a longer grace period: it comes from the plan.
    longer = glmtune_in_process(
        *PLAN, "data.max_length=32768", "train.grad_accum=8", "plan.name=glm4-32k", cwd=tmp_path
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    [job] = [
        j
        for j in map(yaml.safe_load, (p.read_text() for p in emitted(tmp_path)))
        if j["metadata"]["name"] == "glm4-32k"
    ]
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def test_a_plan_that_does_not_fit_emits_nothing(tmp_path):
    proc = glmtune_in_process(
        "mode=plan", "model=glm4_9b_chat", "+hw=t4_16g", "hw.memory_gib=4", "plan.emit=trainjob", cwd=tmp_path
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert emitted(tmp_path) == [] and not list(tmp_path.rglob("glmtune-torch.yaml"))


@pytest.mark.parametrize(
    "args, says",
    [
        (["plan.emit=k8s"], "plan.emit='k8s' is not one of trainjob"),
        (["plan.name=GLM_4"], "plan.name='GLM_4' must be lowercase letters"),
        (["plan.queue=team a"], "is not a Kueue LocalQueue name"),
        (["mode=train"], "use it with mode=plan"),
    ],
)
def test_plan_options_a_cluster_would_refuse_are_one_line_and_exit_2(tmp_path, args, says):
    proc = glmtune_in_process("mode=plan", "plan.emit=trainjob", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("glmtune: error:")]) == 1
    assert not (tmp_path / "outputs").exists() or emitted(tmp_path) == []


def test_the_progress_callback_reports_percent_time_left_and_logged_metrics_as_the_sdk_reads_them(monkeypatch):
    """glmtune's TrainerCallback for Kubeflow Trainer, on transformers' own TrainerState (the HTTP side, the token, the
    5 s spacing and a dead endpoint: test_scaleout.py, through real runs)."""
    import time

    from transformers import TrainerState

    from glmtune.launch.trainjob_status import TrainJobStatus

    callback = TrainJobStatus("http://127.0.0.1:9/status", None, None)
    state = TrainerState(global_step=10, max_steps=40, is_world_process_zero=False)  # a resume at step 10
    callback.on_train_begin(None, state, None)
    callback.on_log(None, state, None, logs={"loss": 1.25, "learning_rate": 5e-4, "grad_norm": 0.5, "epoch": 0.25})
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 30.0)  # 30 s for the 10 steps of this launch
    state.global_step, state.epoch = 20, 0.5
    body = {"trainerStatus": callback.status(state)}
    request = k.TrainerV1alpha1UpdateTrainJobStatusRequest.from_dict(body)
    status = request.trainer_status
    assert status.progress_percentage == 50
    assert status.estimated_remaining_seconds == 60  # 20 steps left at this launch's 3 s a step
    assert status.last_updated_time.tzinfo is not None
    metrics = {m.name: m.value for m in status.metrics}
    assert metrics == {
        "loss": "1.25",
        "learning_rate": "0.0005",
        "grad_norm": "0.5",
        "epoch": "0.5",
        "step": "20",
        "total_steps": "40",
    }
    state.global_step = 40
    assert callback.status(state, done=True) | {"lastUpdatedTime": None} == {
        "lastUpdatedTime": None,
        "progressPercentage": 100,
        "estimatedRemainingSeconds": 0,
        "metrics": [{"name": n, "value": v} for n, v in {**metrics, "step": "40"}.items()],
    }
