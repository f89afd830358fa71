"""The whole launch at scale (issue 25): `mode=probe` on the tiny GLM-4, packing off and on, first and cached.

    python bench/launch_scale.py                         # 200,000 and 1,000,000 conversations
    python bench/launch_scale.py --n 20000 --first off   # a quick check

Each run is the real command (`python -m glmtune mode=probe data.packing=... data.val_file=null`): Hydra, the
data cache, packing, the plan, the tiny model's load and the probe's real optimizer steps. A "first" run uses a
fresh data cache folder (the entry is built); a "cached" run reuses the folder of the first run (the entry opens
memory-mapped). Printed per run: wall time of the whole command, its data stage (the `data: ... in X s` line) and
peak RSS: ru_maxrss from wait4, the largest resident set of the command and the processes it waited for (the
map workers of a build). The target: cached <= 25 % of the first launch's wall, peak RSS <= 1 GB.

The conversations are bench/data_cache.py's: the shipped samples cycled, a numbered tag in each user turn.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_cache import DATA_LINE, make_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def launch(data: Path, cache: Path, packing: str, run_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "glmtune",
        "mode=probe",
        f"data.train_file={data}",
        "data.val_file=null",
        f"data.cache_dir={cache}",
        f"data.packing={packing}",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    found = DATA_LINE.search(out)
    rows = re.search(r"train: micro-batches of \d+ examples -> ([\d.]+) rows", out)
    return {
        "wall": wall,
        "data_s": float(found.group(4)) if found else float("nan"),
        "how": found.group(3) if found else "?",
        "rss_gb": usage.ru_maxrss * 1024 / 1e9,
        "rows": rows.group(1) if rows else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--packing", nargs="+", default=["off", "on"])
    parser.add_argument("--work", type=Path, default=None, help="folder for the data and caches (default: a temp dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="glmtune-launch-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}"
    )
    print(
        "| conversations | packing | launch | wall s | data stage s | peak RSS GB | rows per micro-batch | cached / first |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.n:
        data = work / f"conv{n}.jsonl"
        if not data.exists():
            make_data(data, n)
        for packing in args.packing:
            cache = work / f"cache-{n}-{packing}"
            first = launch(data, cache, packing, work / f"run-{n}-{packing}-first")
            cached = launch(data, cache, packing, work / f"run-{n}-{packing}-cached")
            for name, r in (("first", first), ("cached", cached)):
                ratio = f"{cached['wall'] / first['wall']:.0%}" if name == "cached" else ""
                print(
                    f"| {n:,} | {packing} | {name} ({r['how']}) | {r['wall']:.1f} | {r['data_s']:.2f} | "
                    f"{r['rss_gb']:.2f} | {r['rows']} | {ratio} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
