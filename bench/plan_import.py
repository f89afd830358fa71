"""What `mode=plan` costs beside importing the stack it runs on (issue 32): the plan must stay near instant.

    python bench/plan_import.py                 # 7 repeats of each, medians, ratio
    python bench/plan_import.py --repeats 3     # a quick check

Both commands run in fresh processes, interleaved so that a busy machine slows both alike, from an empty
folder (no run dir is kept: mode=plan without hydra.run.dir writes into a temporary one):
- baseline: `python -c "import torch, transformers"`
- plan:     `python -m glmtune mode=plan model=glm4_9b_chat +hw=a100_40g` (Hydra, the config checks, the plan
            and its tables; no weights, no tokenizer, no GPU)
The ratio of the medians is the number to watch: <= 1.3 means the plan imports planning only (the model code,
the tokenizers and accelerate stay unloaded) and composes its config once (config/compose.py). The exit code is 1
when the wall-clock ratio is above --target. The CPU-time ratio (user + system of the child) is printed beside it:
on a machine that other work keeps busy, wall clock is inflated unevenly, CPU time much less.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BASELINE = [sys.executable, "-c", "import torch, transformers"]
PLAN = [sys.executable, "-m", "glmtune", "mode=plan", "model=glm4_9b_chat", "+hw=a100_40g"]


def seconds(cmd: list[str], cwd: str) -> tuple[float, float]:
    """(wall clock, CPU time of the child) in seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--target", type=float, default=1.3)
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {
        "import torch, transformers": [],
        "mode=plan glm4_9b_chat a100_40g": [],
    }
    with tempfile.TemporaryDirectory(prefix="glmtune-plan-bench-") as cwd:
        seconds(BASELINE, cwd)  # warm the file cache once; not counted
        seconds(PLAN, cwd)
        for _ in range(args.repeats):
            for name, cmd in zip(times, (BASELINE, PLAN)):
                times[name].append(seconds(cmd, cwd))
    print(f"{platform.node()}, {platform.python_version()}, {args.repeats} repeats each, fresh processes")
    print(f"{'command':<34} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU median s':>13}")
    for name, values in times.items():
        wall = [w for w, _ in values]
        print(
            f"{name:<34} {statistics.median(wall):>9.2f} {min(wall):>7.2f} {max(wall):>7.2f} "
            f"{statistics.median(c for _, c in values):>13.2f}"
        )
    (base, plan), (base_cpu, plan_cpu) = ([statistics.median(x[i] for x in v) for v in times.values()] for i in (0, 1))
    ratio = plan / base
    print(f"ratio plan / import: {ratio:.2f} wall clock, {plan_cpu / base_cpu:.2f} CPU time (target <= {args.target})")
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
