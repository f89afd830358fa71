"""`mode=plan plan.emit=trainjob`: the Kubeflow Trainer v2 objects that run this plan, built with the official SDK's
models (`kubeflow_trainer_api`, the `kubeflow` extra) and written as YAML into the run dir:

    trainjob.yaml        the TrainJob: numNodes, numProcPerNode and resourcesPerNode from the plan, the command
    glmtune-torch.yaml   the ClusterTrainingRuntime it names; the same file every time: apply it once per cluster

The torch-distributed contract: the controller gives each node's trainer container (named `node`) PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads as its --nnodes,
--nproc_per_node, --node_rank, --master_addr and --master_port (a static rendezvous: no rendezvous flags). The
container runs `python -m glmtune.supervise torchrun -m glmtune <overrides>`: torchrun under glmtune's supervisor
(launch/supervise.py), so that SIGTERM (Kueue's pre-emption, a node drain) reaches the ranks, which finish the step,
save one complete checkpoint and exit 7, and any other failure exits with the rank's documented code; plain torchrun
would exit 1 with a traceback either way. GLMTUNE_RUN_ID=<name> names the run dir, outputs/<name> under the shared
volume's mount (the container's working dir), so the pods of a re-admitted TrainJob resume it (launch/ranks.py).

The quota Kueue admits against is the pods' requests: GPUs as the plan's processes per node, memory as the plan's
host RAM per node (plan.json `host`), CPUs as CPUS_PER_PROCESS per process. Memory and CPU are requests without a
limit: a limit at an estimate would have the kernel kill a node for the estimate's error.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path

import yaml
from kubeflow_trainer_api import models as k

from .. import __version__
from ..config import RunConfig
from ..config.units import GIB
from ..plan.planner import Plan
from ..rundir.atomic import write_text
from .grace import grace_seconds

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "glmtune-torch"
NODE = "node"  # the runtime's replicated job and its trainer container: the torch plugin injects PET_* there
MOUNT = "/glmtune"  # the shared volume in every pod: run dirs (outputs/<name>) and glmtune's cache (cache/)
MANAGER = "glmtune/plan"  # our entry of spec.runtimePatches (each manager owns one)
CPUS_PER_PROCESS = 4  # a rank's main thread, its DataLoader and tokenizer work, NCCL's proxy threads
# Exits that a restart would repeat (README "When a run fails": 2 bad input, 3 does not fit, 4 out of memory,
# 6 remote code, 8 diverged, 9 no trial): the Job fails at once and JobSet does not recreate it. Any other failure
# (1 a crash, 5 NCCL, 7 a SIGTERM outside a suspension such as a node drain, a killed pod) recreates the whole
# JobSet, up to MAX_RESTARTS times, and the same command resumes from the last complete checkpoint.
FINAL_EXITS = [2, 3, 4, 6, 8, 9]
MAX_RESTARTS = 3


def default_name(run: RunConfig) -> str:
    """<model>-lora-<6 hex>: a valid name (plan.name's rule, config/planemit.py), new for every emit."""
    return f"{run.model.name.replace('_', '-')}-lora-{secrets.token_hex(3)}"


def image(run: RunConfig) -> str:
    return run.plan.image or f"glmtune:{__version__}"


def trainer_args(overrides: list[str]) -> list[str]:
    """The user's overrides, less what only the planning command needs (mode=plan, plan.*, hydra.*): the pods
    train with the same config, and the run dir is the TrainJob's."""

    def key(arg: str) -> str:
        return arg.split("=", 1)[0].lstrip("+~")

    return [a for a in overrides if key(a) != "mode" and not key(a).startswith(("plan.", "hydra.", "hydra/"))]


def resources(run: RunConfig, plan: Plan) -> k.IoK8sApiCoreV1ResourceRequirements:
    procs = run.dist.nproc_per_node
    requests = {"cpu": k.IoK8sApimachineryPkgApiResourceQuantity(str(CPUS_PER_PROCESS * procs))}
    if plan.host.get("bytes"):
        requests["memory"] = k.IoK8sApimachineryPkgApiResourceQuantity(f"{math.ceil(plan.host['bytes'] / GIB)}Gi")
    if plan.budget_bytes is None:  # a plan for this machine's CPU: no GPU to ask for
        return k.IoK8sApiCoreV1ResourceRequirements(requests=requests)
    gpus = k.IoK8sApimachineryPkgApiResourceQuantity(str(procs))  # extended resources: requests = limits
    return k.IoK8sApiCoreV1ResourceRequirements(
        requests={**requests, "nvidia.com/gpu": gpus}, limits={"nvidia.com/gpu": gpus}
    )


def trainjob(run: RunConfig, plan: Plan, overrides: list[str], name: str, grace: int) -> k.TrainerV1alpha1TrainJob:
    env = [
        k.IoK8sApiCoreV1EnvVar(name="GLMTUNE_RUN_ID", value=name),  # the run dir: outputs/<name> (launch/ranks.py)
        k.IoK8sApiCoreV1EnvVar(name="GLMTUNE_CACHE", value=f"{MOUNT}/cache"),  # data cache and tiny models, shared
        k.IoK8sApiCoreV1EnvVar(name="OMP_NUM_THREADS", value="1"),
    ]  # torchrun's own default, without its banner
    trainer = k.TrainerV1alpha1Trainer(
        image=image(run),
        command=["python", "-m", "glmtune.supervise", "torchrun", "-m", "glmtune"],
        args=trainer_args(overrides),
        env=env,
        num_nodes=run.dist.nnodes,
        num_proc_per_node=run.dist.nproc_per_node,
        resources_per_node=resources(run, plan),
    )
    pod = k.TrainerV1alpha1PodSpecPatch(
        termination_grace_period_seconds=grace,
        volumes=[
            k.IoK8sApiCoreV1Volume(
                name="glmtune",
                persistent_volume_claim=(k.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(claim_name=run.plan.volume)),
            )
        ],
        containers=[
            k.TrainerV1alpha1ContainerPatch(
                name=NODE, volume_mounts=[k.IoK8sApiCoreV1VolumeMount(name="glmtune", mount_path=MOUNT)]
            )
        ],
    )
    job = k.TrainerV1alpha1ReplicatedJobPatch(
        name=NODE,
        template=k.TrainerV1alpha1JobTemplatePatch(
            spec=k.TrainerV1alpha1JobSpecPatch(template=k.TrainerV1alpha1PodTemplatePatch(spec=pod))
        ),
    )
    jobset = k.TrainerV1alpha1JobSetTemplatePatch(spec=k.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[job]))
    patch = k.TrainerV1alpha1RuntimePatch(
        manager=MANAGER, training_runtime_spec=(k.TrainerV1alpha1TrainingRuntimeSpecPatch(template=jobset))
    )
    labels = {"kueue.x-k8s.io/queue-name": run.plan.queue} if run.plan.queue else None
    return k.TrainerV1alpha1TrainJob(
        api_version=API_VERSION,
        kind="TrainJob",
        metadata=k.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=name, labels=labels),
        spec=k.TrainerV1alpha1TrainJobSpec(
            runtime_ref=k.TrainerV1alpha1RuntimeRef(
                api_group="trainer.kubeflow.org", kind="ClusterTrainingRuntime", name=RUNTIME
            ),
            trainer=trainer,
            runtime_patches=[patch],
        ),
    )


def runtime(default_image: str) -> k.TrainerV1alpha1ClusterTrainingRuntime:
    """glmtune-torch: the torch-distributed runtime's shape (one replicated job `node`, the torch ML policy) with
    the container's working dir on the shared volume, and failures sorted into final ones and ones a restart fixes."""
    final = k.IoK8sApiBatchV1PodFailurePolicy(
        rules=[
            k.IoK8sApiBatchV1PodFailurePolicyRule(
                action="FailJob",
                on_exit_codes=k.IoK8sApiBatchV1PodFailurePolicyOnExitCodesRequirement(
                    container_name=NODE, operator="In", values=FINAL_EXITS
                ),
            )
        ]
    )
    pod = k.IoK8sApiCoreV1PodSpec(
        restart_policy="Never",  # a failed rank is not restarted alone: the JobSet is
        containers=[k.IoK8sApiCoreV1Container(name=NODE, image=default_image, working_dir=MOUNT)],
    )
    job = k.JobsetV1alpha2ReplicatedJob(
        name=NODE,
        template=k.IoK8sApiBatchV1JobTemplateSpec(
            metadata=k.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
                labels={"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
            ),
            spec=k.IoK8sApiBatchV1JobSpec(
                backoff_limit=0, pod_failure_policy=final, template=k.IoK8sApiCoreV1PodTemplateSpec(spec=pod)
            ),
        ),
    )
    failures = k.JobsetV1alpha2FailurePolicy(
        max_restarts=MAX_RESTARTS,
        rules=[
            k.JobsetV1alpha2FailurePolicyRule(
                name="finalExit", action="FailJobSet", on_job_failure_reasons=["PodFailurePolicy"]
            )
        ],
    )
    return k.TrainerV1alpha1ClusterTrainingRuntime(
        api_version=API_VERSION,
        kind="ClusterTrainingRuntime",
        metadata=k.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=RUNTIME, labels={"trainer.kubeflow.org/framework": "torch"}
        ),
        spec=k.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=k.TrainerV1alpha1MLPolicy(num_nodes=1, torch=k.TrainerV1alpha1TorchMLPolicySource()),
            template=k.TrainerV1alpha1JobSetTemplateSpec(
                spec=k.JobsetV1alpha2JobSetSpec(failure_policy=failures, replicated_jobs=[job])
            ),
        ),
    )


def to_yaml(obj) -> str:
    return yaml.safe_dump(obj.to_dict(), sort_keys=False, default_flow_style=False)


def emit(run: RunConfig, plan: Plan, arch, overrides: list[str], run_dir: Path) -> str:
    """Write both files into the run dir; returns the console lines saying what they ask for and what to apply."""
    name, grace = run.plan.name or default_name(run), grace_seconds(run, arch, plan.choices)
    job = trainjob(run, plan, overrides, name, grace)
    job_file, runtime_file = run_dir / "trainjob.yaml", run_dir / f"{RUNTIME}.yaml"
    write_text(runtime_file, to_yaml(runtime(f"glmtune:{__version__}")))
    write_text(job_file, to_yaml(job))
    requests = job.spec.trainer.resources_per_node.requests
    per_node = ", ".join(f"{q.actual_instance} {'GPUs' if r == 'nvidia.com/gpu' else r}" for r, q in requests.items())
    lines = [
        f"TrainJob {name}: {run.dist.nnodes} node(s) x {run.dist.nproc_per_node} process(es); requests per node: "
        f"{per_node}",
        f"terminationGracePeriodSeconds {grace} (the step in flight, one complete checkpoint, the "
        "exit); run dir on the shared volume:",
        f"  PersistentVolumeClaim {run.plan.volume}, {MOUNT}/outputs/{name}",
        f"Kueue queue {run.plan.queue}"
        if run.plan.queue
        else "no plan.queue: Kueue neither admits nor pre-empts it (plan.queue=<LocalQueue>)",
    ]
    if not run.plan.image:
        lines.append(f"the image {image(run)} is a placeholder: build one with glmtune installed, or set plan.image")
    return "\n".join(
        [
            *lines,
            f"written to {run_dir}:",
            f"  kubectl apply -f {runtime_file}   # once per cluster",
            f"  kubectl apply -f {job_file}",
        ]
    )
