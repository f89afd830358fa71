"""mode=serve under load: requests/s, completion tokens/s and latency at 1, 2, 4 and 8 concurrent clients.

    python bench/serve_load.py                                   # the tiny built-in model (CPU is fine)
    python bench/serve_load.py model=glm4_9b_chat model.path=/models/glm-4-9b-chat --requests 32 --max-tokens 128

Starts `python -m glmtune mode=serve serve.port=0 <overrides>` as a user would, waits for its start line, and
sends --requests chat completions (greedy, max_tokens fixed, prompts of varied length) with the official openai
client from N threads at a time. "batched rows" is the mean batch size the server logged (serve/engine.py logs
each batch), so the table shows whether concurrent requests really shared generate() calls.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

PROMPTS = [
    "What is the capital of France?",
    "你好，介绍一下你自己",
    "Add 2 and 3.",
    "Write one sentence about the sea.",
    "Translate 'good morning' into Chinese.",
    "List three prime numbers.",
    "What does LoRA stand for?",
    "Say hello in five languages.",
]


def start(overrides: list[str], run_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "glmtune", "mode=serve", "serve.port=0", f"hydra.run.dir={run_dir}", *overrides],
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        print(line, end="")
        if "glmtune serve: http://" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split()[2]
    raise SystemExit(f"mode=serve exited with {proc.wait()} before listening")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args, overrides = parser.parse_known_args()
    run_dir = Path(tempfile.mkdtemp(prefix="glmtune-serve-load-"))
    proc, url = start(overrides, run_dir)
    try:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def one(i: int) -> tuple[float, int]:
            began = time.perf_counter()
            reply = client.chat.completions.create(
                model=model,
                temperature=0,
                max_tokens=args.max_tokens,
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] * (1 + i % 3)}],
            )
            return time.perf_counter() - began, reply.usage.completion_tokens

        one(0)  # the first request of a process pays one-off costs the others do not
        print(f"\n{'clients':>7} {'requests/s':>10} {'tokens/s':>9} {'latency p50 s':>13} {'batched rows':>12}")
        log = run_dir / "rank0.log"
        for clients in (1, 2, 4, 8):
            logged = log.read_text().count("\n") if log.exists() else 0
            began = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(one, range(args.requests)))
            wall = time.perf_counter() - began
            new_lines = "".join(log.read_text().splitlines(True)[logged:])
            rows = [int(m) for m in re.findall(r"batch \d+: (\d+) rows", new_lines)]
            latency = sorted(r[0] for r in results)[len(results) // 2]
            print(
                f"{clients:>7} {len(results) / wall:>10.2f} {sum(r[1] for r in results) / wall:>9.1f} "
                f"{latency:>13.3f} {sum(rows) / max(1, len(rows)):>12.2f}"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
