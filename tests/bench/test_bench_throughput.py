"""bench/throughput.py runs end to end through the Trainer (CPU, tiny model): one table row per configuration."""

import subprocess
import sys

import pytest


@pytest.mark.slow  # ~40 s on 2 CPU cores: model build and 4 short Trainer runs
def test_throughput_bench_runs_tiny(repo):
    out = subprocess.run(
        [
            sys.executable,
            "bench/throughput.py",
            "--tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--compile",
            "off",
            "--cases",
            "demo,2k",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| demo") or line.startswith("| 2k")]
    assert [r.split("|")[1:3] for r in rows] == [[" demo ", " off "], [" demo ", " on "], [" 2k ", " off "]]
    packed, unpacked = (float(r.split("|")[7]) for r in (rows[1], rows[0]))  # tokens per step
    assert packed == unpacked  # the same 8 examples a step, packed or not (issue 31)
    packed_rows, unpacked_rows = (int(r.split("|")[6].split(" x ")[0]) for r in (rows[1], rows[0]))
    assert unpacked_rows == 8 and packed_rows < 8  # rows of 512 positions hold ~2-3 demo examples
