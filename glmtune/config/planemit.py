"""plan.*: the cluster objects `mode=plan plan.emit=trainjob` writes (glmtune/scale/trainjob.py), checked with the
rest of the config so that a name Kubernetes would refuse is one line now, not an error at `kubectl apply`."""

from __future__ import annotations

import importlib.util
import re

from .schema import RunConfig

EMITS = ("trainjob",)
# The TrainJob CRD takes an RFC 1035 label; JobSet names its pods' hosts <name>-node-<node>-0, which must stay a
# 63-character DNS label too, so 50 leaves room for up to 999 nodes.
NAME_MAX = 50
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUEUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")  # a label value (Kueue's queue-name), <= 63
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # a PVC: DNS subdomain


def plan_problems(cfg: RunConfig) -> list[str]:
    plan = cfg.plan
    if plan.emit is None:
        return []
    if plan.emit not in EMITS:
        return [f"plan.emit={plan.emit!r} is not one of {', '.join(EMITS)} (or null: the plan only)"]
    problems = []
    if cfg.mode != "plan":
        problems.append(
            f"plan.emit={plan.emit} writes the objects that run a plan: use it with mode=plan, then "
            "kubectl apply the files (mode=train runs here, not on the cluster)"
        )
    if plan.name is not None and not (_NAME.match(plan.name) and len(plan.name) <= NAME_MAX):
        problems.append(
            f"plan.name={plan.name!r} must be lowercase letters, digits and '-', start with a letter, "
            f"end with a letter or digit, at most {NAME_MAX} characters (a Kubernetes name), e.g. "
            "glm4-lora-r16"
        )
    if plan.queue is not None and not (_QUEUE.match(plan.queue) and len(plan.queue) <= 63):
        problems.append(
            f"plan.queue={plan.queue!r} is not a Kueue LocalQueue name (letters, digits, '-', '_', '.', "
            "at most 63 characters)"
        )
    if not (_CLAIM.match(plan.volume or "") and len(plan.volume) <= 253):
        problems.append(
            f"plan.volume={plan.volume!r} is not a PersistentVolumeClaim name (lowercase letters, digits, '-' and '.')"
        )
    if plan.image is not None and (not plan.image.strip() or any(c.isspace() for c in plan.image)):
        problems.append(f"plan.image={plan.image!r} is not an image reference (e.g. registry.example/glmtune:0.1)")
    if importlib.util.find_spec("kubeflow_trainer_api") is None:
        problems.append(
            f'plan.emit={plan.emit} builds the objects with the Kubeflow SDK: pip install "glmtune[kubeflow]"'
        )
    return problems
