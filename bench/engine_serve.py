"""vLLM against glmtune's mode=serve on the same export: completion tokens/s at 8 concurrent clients (issue 40).

    python bench/engine_serve.py                      # tiny GLM-4, head size 32 (vLLM's CPU attention needs >= 32)
    python bench/engine_serve.py --requests 64 --max-tokens 64 --hidden 512 --layers 4

Makes a tiny GLM-4 checkpoint, exports it with `mode=infer infer.merge_to=E` (remote layout: what vLLM's ChatGLM
model serves), then serves E with `python -m glmtune mode=serve` and with the `vllm serve` command glmtune printed
for E (run through tests/infer/vllm_cli.py with the engines venv's Python: the CPU build's own `vllm` launcher cannot
start, see that file), and sends the same --requests chat completions (greedy, max_tokens fixed, `ignore_eos`
where the server takes it) from --clients threads with the official openai client. tokens/s = completion tokens
the servers report / wall time; the first request of each server is not timed. vLLM runs with a 1 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE=1), compiled as its serve command does by default (its start-up is reported apart).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.engines import engines_python  # noqa: E402 - tests/helpers holds the engines venv lookup
from serve_load import PROMPTS, start  # noqa: E402


def load(client: OpenAI, model: str, requests: int, clients: int, max_tokens: int, extra: dict) -> tuple[int, float]:
    def one(i: int) -> int:
        reply = client.chat.completions.create(
            model=model,
            temperature=0,
            max_tokens=max_tokens,
            extra_body=extra,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] * (1 + i % 3)}],
        )
        return reply.usage.completion_tokens

    one(0)
    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens, time.perf_counter() - began


def vllm_server(command: str, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    args = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    began = time.perf_counter()
    proc = subprocess.Popen(
        [str(engines_python()), str(REPO / "tests" / "infer" / "vllm_cli.py"), *args[1:], "--port", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=5)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited {proc.returncode}: see {log}")
        try:
            client.models.list()
            return proc, time.perf_counter() - began
        except Exception:  # noqa: BLE001 - still starting
            time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--port", type=int, default=8931)
    args = parser.parse_args()
    from glmtune.models.loading import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="glmtune-engine-serve-"))
    base = make_tiny_checkpoint(
        root / "base",
        "glm4",
        hidden_size=args.hidden,
        num_layers=args.layers,
        kv_channels=32,
        num_attention_heads=args.hidden // 32,
        ffn_hidden_size=2 * args.hidden,
    )
    export = root / "export"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "glmtune",
            "mode=infer",
            f"model.path={base}",
            f"infer.merge_to={export}",
            f"hydra.run.dir={root / 'merge'}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    command = done.stdout.strip().splitlines()[-1]
    print(f"export: {export}\nvLLM command as printed: {command}\n")
    rows = []
    proc, url = start(
        [f"model.path={export}", f"infer.max_new_tokens={args.max_tokens}", f"serve.max_batch={args.clients}"],
        root / "serve",
    )
    try:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        rows.append(
            (
                "glmtune mode=serve",
                None,
                *load(client, client.models.list().data[0].id, args.requests, args.clients, args.max_tokens, {}),
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    engine, startup = vllm_server(command, args.port, root / "vllm.log")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=600)
        rows.append(
            (
                "vLLM serve (CPU)",
                startup,
                *load(
                    client,
                    client.models.list().data[0].id,
                    args.requests,
                    args.clients,
                    args.max_tokens,
                    {"ignore_eos": True},
                ),
            )
        )
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(60)
    print(f"{'server':<20} {'start s':>7} {'requests':>8} {'clients':>7} {'tokens':>6} {'wall s':>6} {'tokens/s':>8}")
    for name, up, tokens, wall in rows:
        print(
            f"{name:<20} {'' if up is None else f'{up:.0f}':>7} {args.requests:>8} {args.clients:>7} {tokens:>6} "
            f"{wall:>6.1f} {tokens / wall:>8.1f}"
        )


if __name__ == "__main__":
    main()
