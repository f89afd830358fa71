"""mode=serve against large request bodies: the answer, how long /health takes meanwhile, and the server's RSS.

    python bench/serve_guard.py                                   # the tiny built-in model (CPU is fine)
    python bench/serve_guard.py model=glm4_9b_chat model.path=/models/glm-4-9b-chat

Starts the server as a user would (bench/serve_load.py's `start`), then for each body: sends it with httpx (a
chunked upload: no Content-Length, so only the bytes read can stop it), asks /health every 20 ms from another
thread while the body is in flight, and samples the server's VmRSS every 5 ms. The bodies: over the cap (413
after serve.max_body_mib MiB), and one under it whose text is far longer than the context (parsed and tokenized
on the parser thread, then a 400), the case that used to hold the event loop for seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serve_load import start


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def chunked(body: bytes, chunk: int = 1 << 20):
    for at in range(0, len(body), chunk):
        yield body[at : at + chunk]


def measure(base: str, pid: int, model: str, body: bytes) -> dict:
    done, health, peak = threading.Event(), [], [rss(pid)]
    baseline = peak[0]

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.005)

    def poll():
        while not done.is_set():
            began = time.perf_counter()
            httpx.get(base + "/health", timeout=60)
            health.append(time.perf_counter() - began)
            time.sleep(0.02)

    threads = [threading.Thread(target=sample), threading.Thread(target=poll)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    try:
        reply = httpx.post(
            base + "/v1/chat/completions",
            content=chunked(body),
            timeout=600,
            headers={"Content-Type": "application/json"},
        )
    finally:
        seconds = time.perf_counter() - began
        done.set()
        for thread in threads:
            thread.join()
    return {
        "status": reply.status_code,
        "code": reply.json()["error"]["code"] if reply.status_code >= 400 else "",
        "seconds": seconds,
        "health_n": len(health),
        "health_max": max(health, default=0.0),
        "health_p50": statistics.median(health) if health else 0.0,
        "rss_growth": peak[0] - baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="*", default=[100, 50], help="bodies over the cap")
    parser.add_argument("--text-mb", type=int, default=15, help="a body under the cap, its text beyond the context")
    args, overrides = parser.parse_known_args()
    proc, url = start(overrides, Path(tempfile.mkdtemp(prefix="glmtune-serve-guard-")))
    base = url.rsplit("/v1", 1)[0]
    try:
        model = httpx.get(url + "/models").json()["data"][0]["id"]
        bodies = [
            (
                f"{mb} MB, chunked",
                b'{"model": "%s", "messages": [{"role": "user", "content": "' % model.encode()
                + b"x" * (mb * 10**6)
                + b'"}]}',
            )
            for mb in args.sizes_mb
        ]
        text = ("a long prompt, word after word. " * (args.text_mb * 10**6 // 32 + 1))[: args.text_mb * 10**6]
        bodies.append(
            (
                f"{args.text_mb} MB of text, chunked",
                json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode(),
            )
        )
        print("| body | answer | seconds | /health asked | /health max | /health median | server RSS growth |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, body in bodies:
            r = measure(base, proc.pid, model, body)
            print(
                f"| {name} | {r['status']} {r['code']} | {r['seconds']:.2f} | {r['health_n']} | "
                f"{r['health_max'] * 1000:.0f} ms | {r['health_p50'] * 1000:.0f} ms | {r['rss_growth'] / 1e6:.0f} MB |"
            )
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
