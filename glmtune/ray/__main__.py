"""`python -m glmtune.ray --workers N [--max-failures K] [options] <glmtune overrides>`: a run on Ray Train V2.

    ray job submit -- python -m glmtune.ray --workers 16 --max-failures 3 --storage /shared/glmtune \\
        +hw=a100_80g model=glm4_9b_chat model.path=/shared/models/glm-4-9b-chat
    python -m glmtune.ray --workers 2-8 ...     # elastic: starts with at least 2 workers, grows to 8 as nodes come

A TorchTrainer whose workers each run one glmtune rank (ray/worker.py). The run dir is <storage>/<name>/glmtune,
where <storage> is the RunConfig's storage_path: a folder every node mounts (a path on one node's disk works on a
one-node cluster only). When a worker or its node is lost, Ray restarts the whole group (FailureConfig(max_failures
=K)) and glmtune resumes from its last complete checkpoint in that dir; with --workers MIN-MAX the new group may have
another size, and glmtune re-plans for it. `--name` of an earlier run resumes that run.

Exit codes are glmtune's (launch/exits.py), with the rank's one line; a failure Ray's restarts did not
fix exits with its rank's code (1 when no rank said why, e.g. a worker killed K + 1 times).
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
from pathlib import Path

from ..config import ConfigError, check_override_keys
from ..config.cli import check_command_line, chosen_mode
from ..launch.console import fail
from ..launch.exits import ERROR_PREFIX, EXIT_CRASH


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glmtune.ray",
        description="glmtune on Ray Train V2: one glmtune "
        "rank per worker, the run dir on shared storage, resumed after a lost worker.",
    )
    parser.add_argument("--workers", required=True, help="N workers (one rank each), or MIN-MAX: elastic")
    parser.add_argument("--max-failures", type=int, default=0, help="worker-group restarts Ray may make (-1: any)")
    parser.add_argument(
        "--storage",
        default="outputs/ray",
        help="RunConfig(storage_path): a folder every node "
        "mounts; the run dir is <storage>/<name>/glmtune (default: ./outputs/ray, for one node)",
    )
    parser.add_argument(
        "--name",
        help="the run's name and folder; an earlier run's name resumes it "
        "(default: glmtune-<date>-<time>-<4 hex>, new each time)",
    )
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, help="default: 1 when the cluster has GPUs, else 0")
    parser.add_argument("overrides", nargs="*", help="glmtune's own key=value overrides (python -m glmtune --help)")
    return parser.parse_args(argv)


def checked(args: argparse.Namespace) -> tuple[int | tuple[int, int], Path]:
    """(num_workers for ScalingConfig, the run dir), or one line and exit 2 for anything a worker would refuse."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", args.workers)
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    problems = [] if 0 < low <= high else [f"--workers {args.workers!r}: give N or MIN-MAX with 0 < MIN <= MAX"]
    if args.max_failures < -1:
        problems.append(f"--max-failures {args.max_failures}: give 0 or more (-1: no limit)")
    if "://" in args.storage:
        problems.append(
            f"--storage {args.storage}: glmtune writes its run dir with plain file calls; mount the bucket "
            "or share a file system on every node and give its path"
        )
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name):
        problems.append(f"--name {args.name!r}: letters, digits, '.', '_' and '-' (it names a folder)")
    keys = [a.split("=", 1)[0].lstrip("+~") for a in args.overrides]
    if "hydra.run.dir" in keys:
        problems.append("hydra.run.dir: the run dir is <--storage>/<--name>/glmtune (every worker must find it)")
    if chosen_mode(args.overrides) != "train":
        problems.append(
            f"mode={chosen_mode(args.overrides)}: python -m glmtune.ray trains; run other modes with python -m glmtune"
        )
    try:
        check_command_line(args.overrides)
        check_override_keys(args.overrides)
    except ConfigError as err:
        problems.append(str(err))
    if problems:
        fail("; ".join(problems))
    name = args.name or f"glmtune-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    # Ray keeps its own files in <storage>/<name> (a storage marker, results): glmtune's run dir is a folder of it.
    return (low if low == high else (low, high)), Path(args.storage).expanduser().resolve() / name / "glmtune"


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    workers, run_dir = checked(args)
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
        from ray.train.torch import TorchTrainer
    except ImportError:
        fail('python -m glmtune.ray needs Ray Train: pip install "glmtune[ray]"')
    from .worker import FINAL_FILE, RankFailed, run_rank

    ray.init()  # RAY_ADDRESS (ray job submit sets it), else a local cluster of this machine's CPUs and GPUs
    gpus = (
        args.gpus_per_worker if args.gpus_per_worker is not None else float(ray.cluster_resources().get("GPU", 0) > 0)
    )
    trainer = TorchTrainer(
        run_rank,
        train_loop_config={"overrides": args.overrides, "run_dir": str(run_dir)},
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": args.cpus_per_worker, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=run_dir.parent.name,
            storage_path=str(run_dir.parent.parent),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    name = run_dir.parent.name
    final = run_dir.parent / FINAL_FILE
    final.unlink(missing_ok=True)  # a final exit of an earlier launch: this one runs again
    print(f"glmtune on Ray: {args.workers} worker(s), run dir {run_dir} (resume it with --name {name})", flush=True)
    try:
        trainer.fit()
        failure = None
    except TrainingFailedError as err:
        failure = err
    if final.exists():  # a rank's final exit (2 bad input, 3 does not fit, ...), with or without Ray's restarts
        recorded = json.loads(final.read_text())
        print(recorded["line"] or f"{ERROR_PREFIX}a rank exited {recorded['exit_code']}", file=sys.stderr)
        sys.exit(recorded["exit_code"])
    if failure is None:
        print(f"glmtune on Ray: done; run dir {run_dir}, adapter {run_dir / 'adapter'}", flush=True)
        return
    ranks = [e for e in getattr(failure, "worker_failures", {}).values() if isinstance(e, RankFailed)]
    said = ranks[0].line if ranks and ranks[0].line.startswith("glmtune: ") else ""
    print(
        said
        or f"{ERROR_PREFIX}the Ray run failed after {args.max_failures} restart(s) "
        f"({' '.join(str(failure).split())[:300]})",
        file=sys.stderr,
    )
    print(
        f"glmtune on Ray: the last complete checkpoint is in {run_dir}/checkpoints; the same command with --name "
        f"{name} resumes it",
        file=sys.stderr,
    )
    sys.exit(ranks[0].code if ranks and ranks[0].code > 0 else EXIT_CRASH)


if __name__ == "__main__":
    main()
