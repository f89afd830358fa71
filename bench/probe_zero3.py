"""The probe's share of a 2-rank ZeRO-3 launch on CPU (issue 21 item 6; target: under 25 % of the wall time).

    python bench/probe_zero3.py            # 3 launches with the probe, 3 without
    python bench/probe_zero3.py --runs 1

Each launch is the real command, `torchrun --standalone --nproc_per_node 2 -m glmtune dist=zero3
train.max_steps=6 data.val_file=null` on the tiny model, into its own run dir; the data cache is built once
before timing. Printed per launch: the whole command's wall time, the probe's own clock (probe.json `seconds`,
rank 0) and its share. The probe's marginal cost is the difference of the medians with and without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(run_dir: Path, cache: Path, probe: bool) -> tuple[float, float | None]:
    cmd = [
        "torchrun",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "glmtune",
        "dist=zero3",
        "train.max_steps=6",
        "data.val_file=null",
        f"data.cache_dir={cache}",
        f"probe.enabled={str(probe).lower()}",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"launch failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    report = run_dir / "probe.json"
    return wall, json.loads(report.read_text())["seconds"] if report.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        launch(tmp / "warm", tmp / "cache", probe=False)  # builds the data cache; imports reach the page cache
        rows = []
        for i in range(args.runs):
            for probe in (True, False):
                wall, seconds = launch(tmp / f"run{i}-{probe}", tmp / "cache", probe)
                rows.append((probe, wall, seconds))
    print(f"{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print("| probe | wall s | probe s | probe share |")
    print("|---|---|---|---|")
    for probe, wall, seconds in rows:
        share = f"{seconds / wall:.0%}" if seconds is not None else "-"
        print(f"| {'on' if probe else 'off'} | {wall:.1f} | {seconds if seconds is not None else '-'} | {share} |")
    on = statistics.median(w for p, w, _ in rows if p)
    off = statistics.median(w for p, w, _ in rows if not p)
    print(
        f"median wall: {on:.1f} s with the probe, {off:.1f} s without: the probe adds {on - off:+.1f} s "
        f"({(on - off) / on:+.0%})"
    )


if __name__ == "__main__":
    main()
