"""What `mode=plan` costs beside importing the stack it runs on (issue 32): the plan must stay near instant.

    python bench/plan_import.py                 # 7 repeats of each, medians, ratio
    python bench/plan_import.py --repeats 3     # a quick check

Both commands run in fresh processes, interleaved so that a busy machine slows both alike, from an empty
folder (no run dir is kept: mode=plan without hydra.run.dir writes into a temporary one):
- baseline: `python -c "import torch, transformers"`
- plan:     `python -m glmtune mode=plan model=glm4_9b_chat +hw=a100_40g` (Hydra, the config checks, the plan
            and its tables; no weights, no tokenizer, no GPU)
The ratio of the medians is the number to watch: <= 1.3 means the plan imports planning only (the model code,
the tokenizers and accelerate stay unloaded). The exit code is 1 when it is above --target.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BASELINE = [sys.executable, "-c", "import torch, transformers"]
PLAN = [sys.executable, "-m", "glmtune", "mode=plan", "model=glm4_9b_chat", "+hw=a100_40g"]


def seconds(cmd: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--target", type=float, default=1.3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"import torch, transformers": [], "mode=plan glm4_9b_chat a100_40g": []}
    with tempfile.TemporaryDirectory(prefix="glmtune-plan-bench-") as cwd:
        seconds(BASELINE, cwd)  # warm the file cache once; not counted
        seconds(PLAN, cwd)
        for _ in range(args.repeats):
            for name, cmd in zip(times, (BASELINE, PLAN)):
                times[name].append(seconds(cmd, cwd))
    print(f"{platform.node()}, {platform.python_version()}, {args.repeats} repeats each, fresh processes")
    print(f"{'command':<34} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in times.items():
        print(f"{name:<34} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")
    base, plan = (statistics.median(v) for v in times.values())
    ratio = plan / base
    print(f"ratio plan / import: {ratio:.2f} (target <= {args.target})")
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
