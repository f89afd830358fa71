"""The data stage at scale: first run (cache built) and cached run, with 1 and 2 ranks, on N synthetic conversations.

    python bench/data_cache.py                 # 200,000 conversations (~150 MB JSONL), tiny GLM-4, mode=probe
    python bench/data_cache.py --n 5000        # a quick check

Each run is the real command (`python -m glmtune mode=probe ...`, under `torchrun --standalone` for 2 ranks) with a
fresh data cache folder for the first run and the same folder for the cached run. Printed per run: wall time of
the whole command; per rank the data stage (the `data: ... in X s` line of its rank log: read + sha256 of the
file, then build or memory-mapped open) and its peak RSS; the peak RSS of any other process of the command
(torchrun's agent). The datasets.map workers a builder forks have the rank's command line and environment, so a
rank's peak is the largest of the rank process and its workers: the per-process peak that must stay under 1 GB.
Peak RSS is the kernel's VmHWM of each process, sampled every 50 ms from /proc until it exits.

The conversations are the shipped samples (data/samples/train.jsonl) cycled, each with a numbered tag in the user
turn so that no two lines are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_LINE = re.compile(r"data: (\d+) examples from (\S+) \((built|cached)\) in ([\d.]+) s")


def make_data(path: Path, n: int) -> int:
    samples = [json.loads(line) for line in (REPO / "data/samples/train.jsonl").read_text().splitlines() if line]
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            conversation = samples[i % len(samples)]
            messages = [dict(m) for m in conversation["messages"]]
            user = next(m for m in messages if m["role"] == "user")
            user["content"] = f"[{i}] {user['content']}"
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return path.stat().st_size


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack += children.get(pid, [])
    return out


def _sample(pid: int) -> tuple[int, str] | None:
    """(VmHWM in bytes, role) of a live process; role = 'rank N' for a glmtune rank."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    if not found:
        return None
    env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
    if "torchrun" in cmdline or "torch.distributed.run" in cmdline:
        role = "torchrun agent"
    elif "-m glmtune" in cmdline or "glmtune" in cmdline.split(" ")[-1:]:
        role = f"rank {env.get(b'RANK', b'0').decode()}"
    else:
        role = "other (map worker)"
    return int(found.group(1)) * 1024, role


def run(command: list[str], run_dir: Path) -> dict:
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[int, str]] = {}
    output: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    while process.poll() is None:
        for pid in _descendants(process.pid):
            sample = _sample(pid)
            if sample is not None:
                known = peaks.get(pid)
                role = known[1] if known and sample[1].startswith("other") else sample[1]
                peaks[pid] = (max(sample[0], known[0] if known else 0), role)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    reader.join(5)
    if process.returncode != 0:
        sys.exit("command failed:\n" + "".join(output[-40:]))
    stages = {}
    for log in sorted(run_dir.glob("rank*.log")):
        found = DATA_LINE.findall(log.read_text())
        if found:
            stages[log.stem.replace("rank", "rank ")] = (float(found[0][3]), found[0][2])
    by_role: dict[str, int] = {}
    for peak, role in peaks.values():
        by_role[role] = max(by_role.get(role, 0), peak)
    return {"wall": wall, "stages": stages, "rss": by_role}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200_000, help="conversations (default 200,000)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-length", type=int, default=500)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="glmtune-bench-data-"))
    data = work / "train.jsonl"
    size = make_data(data, args.n)
    print(
        f"{args.n:,} conversations, {size / 1e6:.0f} MB JSONL ({data}); tiny GLM-4, mode=probe, "
        f"data.max_length={args.max_length}\n"
    )
    print(
        "| ranks | run | whole command s | data stage s (per rank) | peak RSS MB (per rank) | other processes' peak RSS MB |"
    )
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        cache = work / f"cache-{ranks}"
        for label in ("first (build)", "cached"):
            run_dir = work / f"run-{ranks}-{label.split()[0]}"
            glmtune = [
                "-m",
                "glmtune",
                "mode=probe",
                f"data.train_file={data}",
                "data.val_file=null",
                f"data.max_length={args.max_length}",
                f"data.cache_dir={cache}",
                f"hydra.run.dir={run_dir}",
            ]
            launcher = (
                [sys.executable]
                if ranks == 1
                else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
            )
            result = run(launcher + glmtune, run_dir)
            stages = ", ".join(f"{s:.2f} ({how})" for s, how in result["stages"].values())
            rank_rss = ", ".join(f"{v / 1e6:.0f}" for k, v in sorted(result["rss"].items()) if k.startswith("rank"))
            others = (
                ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(result["rss"].items()) if not k.startswith("rank"))
                or "-"
            )
            print(f"| {ranks} | {label} | {result['wall']:.1f} | {stages} | {rank_rss} | {others} |", flush=True)
    entry = next((work / "cache-1").glob("train-*/meta.json"), None)
    if entry is not None:
        du = sum(f.stat().st_size for f in entry.parent.rglob("*") if f.is_file())
        print(f"\ncache entry: {du / 1e6:.0f} MB on disk ({entry.parent.name})")
    print(f"files left in {work} (delete when done)")


if __name__ == "__main__":
    main()
